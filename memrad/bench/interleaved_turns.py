"""Affinity on vs off over two interleaved conversations: an agent and its sub-agent.

    python -m memrad.bench.interleaved_turns --turns 6 [--named] [--reps 3]
    memrad bench interleaved --turns 6 --named

affinity_turns' rewriting client, twice over: an agent and a sub-agent with the same
system prompt (the same tools), their requests alternating (agent turn 1, sub-agent turn 1,
agent turn 2, ...), every earlier reply sent back with its second half cut. --named puts
both under one session_id (as Claude Code and opencode do). The affinity-on engine (every
tier) and the affinity-off engine (the prefix tiers and the longest prefix) run the same
requests, alternating which arm goes first. TTFT is engine-side (plan + rebuild + prefill +
first token); with --reps, each rep runs on fresh engines and the table holds per-request
medians. The last line sums TTFT and primed tokens per arm and counts the requests where
on reused fewer tokens than off (the planner's promise: never).
"""

from __future__ import annotations

import statistics

from memrad.bench.affinity_turns import SYSTEM, TOOL_OUTPUT, client_arguments, client_setup
from memrad.engine.build import engine_for, in_process
from memrad.request import GenerationRequest, Identity, SamplingParams

TASKS = ("Step {turn}. Tool result:\n{tool}\nWhat next?",
         "Sub-task {turn}: check the handlers for missing retries. Tool result:\n{tool}\nReport briefly.")


def run(loaded, args, threads: int, identity: Identity | None, system: str = SYSTEM,
        tool: str = TOOL_OUTPUT, rep: int = 0) -> list[dict]:
    """Both arms over the interleaved requests on fresh engines: one row per request. Which
    arm goes first alternates per request and flips with `rep`."""
    arms = {flag: engine_for(loaded, in_process(args.chunk, args.mode, 64, affinity=flag), threads)
            for flag in (True, False)}
    arms[True].init_worker_thread()
    histories = {(flag, who): [{"role": "system", "content": system}] for flag in arms for who in (0, 1)}
    rows = []
    for turn in range(1, args.turns + 1):
        for who in (0, 1):
            done = {}
            for flag in ((True, False) if (turn + who + rep) % 2 else (False, True)):
                messages = histories[flag, who]
                messages.append({"role": "user", "content": TASKS[who].format(turn=turn, tool=tool)})
                engine = arms[flag]
                text, ids = engine.chat.render(messages, None)
                request = GenerationRequest(f"{flag}-{who}-{turn}", engine.model_id, tuple(ids), text,
                                            SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                            identity=identity)
                done[flag] = engine.generate(request, lambda _: None, lambda: False)
                reply = done[flag].text
                messages.append({"role": "assistant", "content": reply[: len(reply) // 2]})
            rows.append(dict(who=("agent", "sub-agent")[who], turn=turn, on=done[True], off=done[False]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = client_arguments(__doc__.splitlines()[0], turns=6, max_tokens=32)
    parser.add_argument("--reps", type=int, default=1, help="whole runs on fresh engines; per-request medians")
    args = parser.parse_args(argv)
    loaded, threads, identity, header = client_setup(args)
    print(f"{header} reps={args.reps} (per-request median TTFT)\n")
    runs = [run(loaded, args, threads, identity, rep=rep) for rep in range(args.reps)]
    print("| conversation | turn | prompt tokens | on: cached | off: cached | on TTFT s | off TTFT s | same text "
          "| on decision (rep 0) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    sums = {"on": 0.0, "off": 0.0}
    for rows in zip(*runs):
        r = rows[0]
        on, off = r["on"], r["off"]
        ttft = {arm: statistics.median(x[arm].ttft_s for x in rows) for arm in sums}
        for arm in sums:
            sums[arm] += ttft[arm]
        same = all(x["on"].text == x["off"].text == on.text for x in rows)
        print(f"| {r['who']} | {r['turn']} | {on.prompt_tokens:,} | {on.cached_tokens:,} | {off.cached_tokens:,} | "
              f"{ttft['on']:.3f} | {ttft['off']:.3f} | {'yes' if same else 'no'} | {on.decision.render()} |",
              flush=True)
    rows = runs[0]
    primed = {arm: sum(r[arm].prompt_tokens - r[arm].cached_tokens for r in rows) for arm in sums}
    fewer = sum(r["on"].cached_tokens < r["off"].cached_tokens for r in rows)
    print(f"\nsummed TTFT over {len(rows)} requests (medians): affinity on {sums['on']:.2f} s, off {sums['off']:.2f} s "
          f"(off/on {sums['off'] / sums['on']:.2f}x); tokens primed: on {primed['on']:,}, off {primed['off']:,}; "
          f"requests where on reused fewer tokens than off: {fewer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
