"""Affinity on vs off over one conversation whose client rewrites every earlier reply.

    python -m memrad.bench.affinity_turns --turns 10

In process on the default model. Each user turn carries a tool result, so the prompt grows
several-fold; the client sends every earlier reply back with its second half cut (what a
reasoning-stripping client does to a reply). Per turn, the affinity-on engine and the
affinity-off engine (same pool settings; prefix tiers only) run the same request,
alternating which arm goes first. TTFT is engine-side: plan + rebuild + prefill + first token.
"""

from __future__ import annotations

import argparse

from memrad.engine.engine import Engine
from memrad.engine.loader import load_model, resolve_threads
from memrad.request import GenerationRequest, Identity, SamplingParams
from memrad.reuse.pool import ReusePool

SYSTEM = ("You are a careful coding agent working in a Python repository. Read before you write, keep "
          "changes small, and run the tests after every change. Tools: read_file(path), write_file(path, "
          "text), list_dir(path), grep(pattern), run_tests(), git_diff(). Every tool returns plain text. ") * 4
TOOL_OUTPUT = "\n".join(f"src/module_{i}.py: def handler_{i}(request): return process(request, retries={i})"
                        for i in range(8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--mode", default="exact")
    parser.add_argument("--named", action="store_true", help="the client sends a session_id")
    args = parser.parse_args(argv)
    threads = resolve_threads(args.threads)
    loaded = load_model(args.model, "auto", "auto")
    arms = {flag: Engine(loaded, args.chunk, threads, ReusePool(64, 2**33), args.mode, affinity=flag)
            for flag in (True, False)}
    arms[True].init_worker_thread()
    identity = Identity("bench", "session_id") if args.named else None
    messages = {flag: [{"role": "system", "content": SYSTEM}] for flag in arms}
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} threads={threads} "
          f"chunk={args.chunk} mode={args.mode} client={'named' if args.named else 'unnamed'} "
          f"max_tokens={args.max_tokens}\n")
    print("| turn | prompt tokens | on: cached | on TTFT s | off TTFT s | off/on | same text | on decision |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    first_on = None
    for turn in range(1, args.turns + 1):
        results = {}
        for flag in ((True, False) if turn % 2 else (False, True)):
            engine = arms[flag]
            messages[flag].append({"role": "user", "content": f"Step {turn}. Tool result:\n{TOOL_OUTPUT}\nWhat next?"})
            text, ids = engine.render_chat(messages[flag], None)
            request = GenerationRequest(f"{flag}-{turn}", engine.model_id, tuple(ids), text,
                                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                        identity=identity)
            results[flag] = engine.generate(request, lambda _: None, lambda: False)
            reply = results[flag].text
            messages[flag].append({"role": "assistant", "content": reply[: len(reply) // 2]})
        on, off = results[True], results[False]
        if first_on is None and on.decision.outcome == "resumed":
            first_on, first_turn = on, turn
        print(f"| {turn} | {on.prompt_tokens} | {on.cached_tokens} | {on.ttft_s:.3f} | {off.ttft_s:.3f} | "
              f"{off.ttft_s / on.ttft_s:.1f}x | {'yes' if on.text == off.text else 'no'} | "
              f"{on.decision.render()} |", flush=True)
    if first_on is not None:
        print(f"\naffinity on, last turn / first resumed turn ({first_turn}): TTFT {on.ttft_s / first_on.ttft_s:.2f}x "
              f"while the prompt grew {on.prompt_tokens / first_on.prompt_tokens:.1f}x "
              f"({first_on.prompt_tokens} -> {on.prompt_tokens} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
