"""`memrad bench speed --spec`: a file-rewrite reply and a fresh reply, plain against speculative.

    memrad bench speed --spec [--threads 2] [--max-tokens 400] [--reps 1]

In one process, each greedy reply (no pool: every run cold, the same prompt each time) runs on
    compiled        the compiled steps as the daemon serves them (compile = auto, max_batch 4, the
                    batched packages open: a lone request decodes on the compiled one-row step),
                    speculate = off
    compiled+spec   the same, speculate = auto: drafts as runs of rows of the compiled 2-, 4-
                    or 8-row step (memrad.engine.speculation)
    eager           the eager one-row step (compile = off, max_batch 1), speculate = off
    eager+spec      the same, speculate = auto: runs on eager batched steps of up to 9 rows
and the table gives decode tok/s (the tokens after the first over the time after the first),
acceptance (drafts kept of drafted), tokens per decode step, and whether the reply's tokens
equal its plain arm's (they must: speculation is exact). Arms interleave per rep, order
reversed every rep; cells are medians. Never run in CI.
"""

from __future__ import annotations

import statistics
import time

from memrad.engine.engine import Engine, EngineOptions
from memrad.request import GenerationRequest, SamplingParams

# arm -> (compile, speculate, max_batch, its plain arm)
ARMS = {"compiled": ("auto", "off", 4, "compiled"), "compiled+spec": ("auto", "auto", 4, "compiled"),
        "eager": ("off", "off", 1, "eager"), "eager+spec": ("off", "auto", 1, "eager")}


def rewrite_file(name: str = "total") -> str:
    """A ~60-line Python module that uses `name` throughout (the rename rewrites it)."""
    lines = ["\"\"\"Small helpers for an order book.\"\"\"", "", "from dataclasses import dataclass", "", ""]
    for index, item in enumerate(("price", "quantity", "discount", "tax", "shipping", "fee")):
        lines += [f"def add_{item}({name}, {item}):",
                  f"    \"\"\"Add the {item} to the running {name}.\"\"\"",
                  f"    if {item} < 0:",
                  f"        raise ValueError(\"{item} must not be negative\")",
                  f"    {name} = {name} + {item} * {index + 1}",
                  f"    return {name}", "", ""]
    lines += ["@dataclass", "class Order:", "    items: list", f"    {name}: float = 0.0", "",
              "    def summary(self):", f"        return f\"{{len(self.items)}} items, {name} {{self.{name}:.2f}}\""]
    return "\n".join(lines) + "\n"


def rewrite_messages() -> list[dict]:
    return [{"role": "system", "content": "You are a careful coding assistant. Reply with code only."},
            {"role": "user", "content": "Rename `total` to `amount` everywhere in this file and give me the whole "
                                        f"file back:\n\n```python\n{rewrite_file()}```"}]


def fresh_messages() -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a "
                                        "bottle. Make it about ten paragraphs."}]


def make_request(engine: Engine, messages: list[dict], rid: str, max_tokens: int) -> GenerationRequest:
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens))


def run(loaded, threads: int, chunk: int, max_tokens: int, reps: int, cpu: str) -> dict:
    engines = {}
    for arm, (compile_mode, speculate, max_batch, _) in ARMS.items():
        engine = Engine(loaded, EngineOptions(chunk, threads, compile=compile_mode, speculate=speculate,
                                              max_batch=max_batch))
        engine.init_worker_thread()
        engine.decoder.start()
        engine.decoder.wait()
        engine.decoder.want_batch()  # the batched packages open (built here first if the cache lacks them)
        engine.decoder.wait()
        engines[arm] = engine
    prompts = {"rewrite": rewrite_messages(), "fresh": fresh_messages()}
    rates: dict[tuple[str, str], list[float]] = {}
    last: dict[tuple[str, str], object] = {}
    for rep in range(reps):
        order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
        for name, messages in prompts.items():
            for arm in order:
                engine = engines[arm]
                started = time.perf_counter()
                completion = engine.generate(make_request(engine, messages, f"{name}-{arm}", max_tokens),
                                             lambda _: None, lambda: False)
                total_s = time.perf_counter() - started
                decode_s = total_s - completion.ttft_s
                rates.setdefault((name, arm), []).append((completion.completion_tokens - 1) / decode_s)
                last[(name, arm)] = completion
        print(f"rep {rep + 1}/{reps} done", flush=True)
    print(f"\nspeculation: model={loaded.model_id} threads={threads} cpu={cpu} max_tokens={max_tokens} reps={reps}")
    print(f"steps: {', '.join(f'{a}={e.decoder.choice.value}/batch {e.decoder.batch_choice.value}' for a, e in engines.items())}")
    print("| reply | arm | tokens | decode tok/s | x plain eager | x compiled | accepted / drafted | tokens per step "
          "| same tokens as its plain arm |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    out = {}
    for name in prompts:
        base = statistics.median(rates[(name, "eager")])
        compiled = statistics.median(rates[(name, "compiled")])
        for arm in ARMS:
            c = last[(name, arm)]
            rate = statistics.median(rates[(name, arm)])
            spec = c.speculation
            figures = (f"{spec.accepted_tokens} / {spec.drafted_tokens}" if spec is not None and spec.on else "-")
            per_step = f"{spec.tokens_per_step:.2f}" if spec is not None and spec.on and spec.decode_steps else "1.00"
            plain = last[(name, ARMS[arm][3])]
            same = c.text == plain.text and c.finish_reason == plain.finish_reason
            print(f"| {name} | {arm} | {c.completion_tokens} | {rate:.1f} | {rate / base:.2f} | {rate / compiled:.2f} "
                  f"| {figures} | {per_step} | {'yes' if same else 'NO'} |")
            out[(name, arm)] = rate
    return out
