"""`memrad bench chunk-probe`: does the prefill chunk size change greedy outputs?

With reuse off, each prompt is greedy-decoded once per chunk size, in process; outputs are
compared with the largest chunk's, and the first differing character and token reported.
Different chunk sizes change GEMM reduction order, so logits move in their last bits and a
near-tie argmax can flip: this is why exact mode resumes only on the canonical grid.
"""

from __future__ import annotations

import argparse

from memrad.bench.scenarios import SHORT
from memrad.engine.build import engine_for, in_process
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.request import GenerationRequest, SamplingParams


def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench chunk-probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt", action="append", help="a user message (repeatable); default: the short scenario's")
    parser.add_argument("--chunks", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    loaded = load_model(args.model, "auto", "auto")
    threads = resolve_threads(args.threads)
    prompts = args.prompt or list(SHORT.user_turns)
    chunks = sorted(args.chunks, reverse=True)
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} threads={threads} "
          f"greedy max_tokens={args.max_tokens}; reference chunk {chunks[0]}\n")
    print("| prompt | tokens | chunk | same as reference | first differing token | first differing char |")
    print("| ---: | ---: | ---: | --- | ---: | ---: |")
    diverged = 0
    for p, prompt in enumerate(prompts, start=1):
        outputs = {}
        for chunk in chunks:
            finished = []
            # no pool: every run is cold
            engine = engine_for(loaded, in_process(chunk, threads=threads), threads, finished.append)
            engine.init_worker_thread()
            text, ids = engine.chat.render([{"role": "system", "content": SHORT.system},
                                            {"role": "user", "content": prompt}], None)
            request = GenerationRequest(f"p{p}-c{chunk}", engine.model_id, tuple(ids), text,
                                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
            done = engine.generate(request, lambda _: None, lambda: False)
            outputs[chunk] = (finished[-1].generated_ids, done.text, len(ids))
        ref_ids, ref_text, n = outputs[chunks[0]]
        for chunk in chunks[1:]:
            got_ids, got_text, _ = outputs[chunk]
            at_token, at_char = first_difference(ref_ids, got_ids), first_difference(ref_text, got_text)
            diverged += at_token is not None
            print(f"| {p} | {n} | {chunk} | {'yes' if at_token is None else 'no'} | "
                  f"{'-' if at_token is None else at_token} | {'-' if at_char is None else at_char} |", flush=True)
    print(f"\n{diverged} of {len(prompts) * (len(chunks) - 1)} runs diverged from the reference chunk")
    return 0
