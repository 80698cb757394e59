"""`memrad bench plan-cost`: what planning one request costs with many long parked sessions.

Builds S parked sessions of T tokens each (records only, no model: planning never touches
state), all opening with the same system prompt as agent clients send, then plans requests
that share the system prompt, or a whole session plus a new turn, and reports medians for:

  index   the pool's prefix index proposes, real tokens confirm (what the engine runs)
  scan    the planner compares the prompt with every session token by token (no index)
  park    adding one session to the index (paid once per finished request)
"""

from __future__ import annotations

import argparse
import random

from memrad.engine.timing import median_s
from memrad.reuse.planner import RequestView, plan
from memrad.reuse.pool import Namespace, ParkedSession, ReusePool

NS = Namespace("bench", None)


def _session(i: int, tokens: tuple[int, ...], prompt: int) -> ParkedSession:
    return ParkedSession(session_id=f"s{i}", namespace=NS, identity=None, token_ids=tokens, text="",
                         prompt_checkpoint=prompt, checkpoints=(), croppable=True, exact_limit=prompt,
                         fingerprint=(), num_bytes=1, created_at=0.0, last_used_at=float(i))


def measure(sessions: int, tokens: int, system: int, chunk: int, reps: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    shared = tuple(rng.randrange(3, 49152) for _ in range(system))
    pool = ReusePool(sessions + 1, 1 << 62)
    parked = []
    for i in range(sessions):
        own = tuple(shared + tuple(rng.randrange(3, 49152) for _ in range(tokens - system)))
        parked.append(_session(i, own, tokens - 32))
    park_s = median_s(lambda: pool.park(parked[0]), 1)
    for s in parked:
        pool.park(s)
    park_s = median_s(lambda: (pool.remove("s0"), pool.park(parked[0])), reps)
    new_conversation = shared + tuple(rng.randrange(3, 49152) for _ in range(200))
    next_turn = parked[sessions // 2].token_ids + tuple(rng.randrange(3, 49152) for _ in range(200))
    out = {"park_ms": park_s * 1e3}
    for name, prompt in (("shared_system", new_conversation), ("next_turn", next_turn)):
        view = RequestView("r", prompt, "", NS)
        everything = pool.sessions()
        out[f"{name}_index_ms"] = 1e3 * median_s(
            lambda: plan(view, pool.sessions(), "exact", chunk, matches=pool.prefix_matches(NS, prompt)), reps)
        out[f"{name}_scan_ms"] = 1e3 * median_s(lambda: plan(view, everything, "exact", chunk), reps)
        decided = plan(view, everything, "exact", chunk, matches=pool.prefix_matches(NS, prompt))
        out[f"{name}_reused"] = decided.checkpoint
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench plan-cost", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args(argv)
    r = measure(args.sessions, args.tokens, args.system, args.chunk, args.reps)
    print(f"{args.sessions} sessions x {args.tokens} tokens, {args.system}-token shared system prompt; "
          f"medians of {args.reps}")
    print(f"  park one session into the index: {r['park_ms']:.2f} ms")
    for name, what in (("shared_system", "new conversation, shared system prompt"),
                       ("next_turn", "next turn of one parked conversation")):
        print(f"  {what}: plan {r[f'{name}_index_ms']:.2f} ms with the index, {r[f'{name}_scan_ms']:.2f} ms "
              f"scanning every session; reuses {r[f'{name}_reused']} tokens")
    return 0
