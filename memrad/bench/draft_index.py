"""`memrad bench draft-index`: what indexing a long conversation's prompt for drafts costs a turn.

An agent's turn 2 resends turn 1's prompt (here `--tokens` tokens of this repository's own source,
tokenized by the model's tokenizer, as the file contents a coding agent reads), turn 1's reply
(`--reply` tokens copied from that source) with its last `--rerendered` tokens rendered otherwise
by the client, and a new message (`--new` tokens). Before the first draft of turn 2 the drafts'
index (memrad.reuse.drafts) must cover that prompt:

  scratch  build it from the whole prompt (what a turn does without the parked index)
  follow   the index parked with turn 1's session, cut back and extended in place (a resume)

and each is checked to equal the one built from scratch. Medians of `--reps`; plus the index's
Python heap (tracemalloc), which the pool's byte cap does not count.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from pathlib import Path

from memrad.reuse.drafts import DraftIndex


def conversation(tokenizer, tokens: int, reply: int, rerendered: int, new: int) -> tuple[list[int], list[int]]:
    """(turn 1's parked tokens: prompt + reply, turn 2's prompt), from memrad's own source."""
    source = Path(__file__).resolve().parents[1]
    ids: list[int] = []
    for path in sorted(source.rglob("*.py")):
        ids += tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens + new:
            break
    prompt, fresh = ids[:tokens], ids[tokens : tokens + new]
    copied = prompt[tokens // 2 : tokens // 2 + reply]  # the reply rewrites part of what it read
    parked = prompt + copied
    turn2 = prompt + copied[: reply - rerendered] + fresh[:rerendered] + fresh
    return parked, turn2


def measure(parked: list[int], turn2: list[int], reps: int) -> dict[str, float]:
    fresh = DraftIndex(turn2)
    times: dict[str, list[float]] = {"scratch": [], "follow": []}
    for _ in range(reps):
        started = time.perf_counter()
        built = DraftIndex(turn2)
        times["scratch"].append(time.perf_counter() - started)
        source = DraftIndex(parked)
        started = time.perf_counter()
        source.follow(turn2)
        times["follow"].append(time.perf_counter() - started)
        assert built == source == fresh, "an index brought to turn 2 differs from one built from scratch"
    tracemalloc.start()
    kept = DraftIndex(turn2)
    heap_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return {**{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}, "heap_bytes": heap_bytes}


def main(argv: list[str] | None = None) -> int:
    from memrad.engine.model.loader import load_model

    parser = argparse.ArgumentParser(prog="memrad bench draft-index", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=16384, help="turn 1's prompt")
    parser.add_argument("--reply", type=int, default=400, help="turn 1's reply")
    parser.add_argument("--rerendered", type=int, default=50, help="the reply's last tokens the client re-renders")
    parser.add_argument("--new", type=int, default=200, help="turn 2's new message")
    parser.add_argument("--reps", type=int, default=11)
    args = parser.parse_args(argv)
    tokenizer = load_model(args.model, "cpu", "auto", progress=lambda _: None).tokenizer
    parked, turn2 = conversation(tokenizer, args.tokens, args.reply, args.rerendered, args.new)
    r = measure(parked, turn2, args.reps)
    print(f"turn 1 parked {len(parked):,} tokens; turn 2's prompt {len(turn2):,} tokens "
          f"({args.rerendered} of the reply re-rendered, {args.new} new); medians of {args.reps}")
    print(f"  scratch (the whole prompt): {r['scratch_ms']:.1f} ms")
    print(f"  follow (the parked index, in place): {r['follow_ms']:.2f} ms")
    print(f"  the index's heap: {r['heap_bytes'] / 2**20:.1f} MiB")
    return 0
