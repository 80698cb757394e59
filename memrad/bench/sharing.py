"""`memrad bench sharing`: what the longest-prefix tier and forks reuse, in process.

    memrad bench sharing --reps 3

Default model, exact mode, fresh engines per rep, arms interleaved (order rotated per rep):

1. Turn 2 of an unnamed client that rewrites each reply (keeps its first half, as a
   reasoning-stripping client does), so turn 2 shares 2 segments with turn 1: under
   affinity's bar of 3, and no prefix probe matches. Arms: both tiers, affinity
   only (MEMRA_LONGEST_PREFIX=0), neither. Reports cached tokens and engine-side TTFT.
2. A new conversation opening with the same ~1.1k-token system prompt and tool list as a
   parked one: longest prefix on vs off. Then the parked conversation's next turn, whose
   output must equal its output on an engine that never saw the second conversation.
"""

from __future__ import annotations

import argparse
import statistics

from memrad.bench.affinity_turns import SYSTEM, TOOL_OUTPUT
from memrad.engine.build import engine_for, in_process
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.request import GenerationRequest, SamplingParams

ARMS = {"both": (True, True), "affinity only": (True, False), "neither": (False, False)}
LONG_SYSTEM = SYSTEM * 4  # ~1.1k tokens: a system prompt and tool list as agents send them


def ask(engine: Engine, messages: list[dict], rid: str, max_tokens: int):
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest(rid, engine.model_id, tuple(ids), text,
                                SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return engine.generate(request, lambda _: None, lambda: False)


def turn_two(loaded, threads: int, chunk: int, arm: str, max_tokens: int):
    affinity, longest = ARMS[arm]
    engine = engine_for(loaded, in_process(chunk, "exact", 8, affinity, longest, threads=threads), threads)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Step 1. Tool result:\n{TOOL_OUTPUT}\nWhat next?"}]
    first = ask(engine, messages, "t1", max_tokens)
    messages += [{"role": "assistant", "content": first.text[: len(first.text) // 2]},
                 {"role": "user", "content": f"Step 2. Tool result:\n{TOOL_OUTPUT}\nWhat next?"}]
    return ask(engine, messages, "t2", max_tokens)


def shared_system(loaded, threads: int, chunk: int, longest: bool, max_tokens: int):
    """(second conversation's completion, the first's next turn text) on one engine."""
    engine = engine_for(loaded, in_process(chunk, "exact", 8, True, longest, threads=threads), threads)
    a = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "List the files."}]
    a1 = ask(engine, a, "a1", max_tokens)
    b = ask(engine, [{"role": "system", "content": LONG_SYSTEM},
                     {"role": "user", "content": "Run the tests and report failures."}], "b1", max_tokens)
    a2 = ask(engine, a + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "Open README.md."}],
             "a2", max_tokens)
    return b, a2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench sharing", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    threads = resolve_threads(args.threads)
    loaded = load_model("default", "auto", "auto")
    print(f"model={loaded.model_id} dtype={loaded.dtype_name} threads={threads} chunk={args.chunk} "
          f"mode=exact reps={args.reps} (medians; TTFT engine-side)")
    rows: dict[str, list] = {arm: [] for arm in ARMS}
    order = list(ARMS)
    for rep in range(args.reps):
        for arm in order[rep % 3:] + order[: rep % 3]:
            rows[arm].append(turn_two(loaded, threads, args.chunk, arm, args.max_tokens))
    print("\n| turn 2, unnamed rewriting client | prompt tokens | cached tokens | TTFT s | decision |")
    print("| --- | ---: | ---: | ---: | --- |")
    for arm, done in rows.items():
        print(f"| {arm} | {done[0].prompt_tokens} | {done[0].cached_tokens} | "
              f"{statistics.median(d.ttft_s for d in done):.3f} | {done[0].decision.render()} |")
    if len({d.text for arm_rows in rows.values() for d in arm_rows}) != 1:
        print("OUTPUTS DIFFER across arms")
    shared: dict[bool, list] = {True: [], False: []}
    for rep in range(args.reps):
        for longest in ((True, False) if rep % 2 == 0 else (False, True)):
            shared[longest].append(shared_system(loaded, threads, args.chunk, longest, args.max_tokens))
    print("\n| new conversation, shared system prompt | prompt tokens | cached tokens | TTFT s | decision |")
    print("| --- | ---: | ---: | ---: | --- |")
    for longest, label in ((True, "longest prefix on"), (False, "longest prefix off")):
        b = [row[0] for row in shared[longest]]
        print(f"| {label} | {b[0].prompt_tokens} | {b[0].cached_tokens} | "
              f"{statistics.median(d.ttft_s for d in b):.3f} | {b[0].decision.render()} |")
    same = {row[1].text for rows_ in shared.values() for row in rows_}
    print(f"\nthe parked conversation's next turn after the fork: "
          f"{'identical' if len(same) == 1 else 'DIFFERENT'} output with and without the fork "
          f"({shared[True][0][1].decision.render()})")
    return 0
