"""Exact vs fast reuse on one conversation: TTFT per turn, warm vs cold, and logit drift.

    python -m memrad.bench.reuse_modes --turns 8 --reps 3

A scripted agent conversation (long system prompt, a user turn and the verbatim reply per
turn) runs in process on the default model. Every turn is run warm (resuming from the pool)
and cold (a fresh cache_salt), in that interleaved order, `--reps` times per mode; the table
gives per-turn medians and the largest |warm - cold| over the first token's logits.
"""

from __future__ import annotations

import argparse
import statistics

from memrad.engine.build import engine_for, in_process
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.request import GenerationRequest, SamplingParams

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read before you write, keep "
    "changes small, and run the tests after every change. Tools: read_file(path), write_file(path, "
    "text), list_dir(path), grep(pattern), run_tests(), git_diff(). Every tool returns plain text. "
) * 6
USER_TURNS = [
    "List the files in the repository root.", "Open README.md and summarise it.",
    "Which module parses the config file?", "Show the function that loads settings.",
    "Add a test for a missing config file.", "Run the tests and report failures.",
    "Explain the failure in one sentence.", "Fix it with the smallest change.",
    "Run the tests again.", "Write the commit message.",
]


def run_mode(loaded, mode: str, turns: int, reps: int, chunk: int, threads: int, max_tokens: int) -> list[dict]:
    rows: list[dict] = [dict(turn=t + 1, warm=[], cold=[], cached=0, prompt=0, drift=0.0) for t in range(turns)]
    for rep in range(reps):
        finished = []
        engine = engine_for(loaded, in_process(chunk, mode, 64, threads=threads), threads, finished.append)
        engine.init_worker_thread()
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
            text, ids = engine.chat.render(messages, None)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            warm = engine.generate(GenerationRequest(f"w{t}", engine.model_id, tuple(ids), text, params),
                                   lambda _: None, lambda: False)
            warm_logits = finished[-1].prompt_logits
            cold = engine.generate(GenerationRequest(f"c{t}", engine.model_id, tuple(ids), text, params,
                                                     cache_salt=f"cold-{rep}-{t}"), lambda _: None, lambda: False)
            row = rows[t]
            row["warm"].append(warm.ttft_s)
            row["cold"].append(cold.ttft_s)
            row["cached"], row["prompt"] = warm.cached_tokens, warm.prompt_tokens
            row["drift"] = max(row["drift"], (warm_logits - finished[-1].prompt_logits).abs().max().item())
            row["same_text"] = warm.text == cold.text
            messages.append({"role": "assistant", "content": warm.text})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["exact", "fast"])
    args = parser.parse_args(argv)
    threads = resolve_threads(args.threads)
    loaded = load_model(args.model, "auto", "auto")
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} threads={threads} "
          f"chunk={args.chunk} reps={args.reps} max_tokens={args.max_tokens} (medians over reps)\n")
    print("| mode | turn | prompt tokens | cached | warm TTFT s | cold TTFT s | cold/warm | max abs logit diff | same text |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for mode in args.modes:
        for row in run_mode(loaded, mode, args.turns, args.reps, args.chunk, threads, args.max_tokens):
            warm, cold = statistics.median(row["warm"]), statistics.median(row["cold"])
            print(f"| {mode} | {row['turn']} | {row['prompt']} | {row['cached']} | {warm:.3f} | {cold:.3f} | "
                  f"{cold / warm:.1f}x | {row['drift']:.2e} | {'yes' if row['same_text'] else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
