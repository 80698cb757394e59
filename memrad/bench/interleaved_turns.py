"""Affinity on vs off over two interleaved conversations: an agent and its sub-agent.

    python -m memrad.bench.interleaved_turns --turns 6 [--named] [--reps 3] [--rewrite first-sentence] [--warm] [--control]
    memrad bench interleaved --turns 6 --named --rewrite first-sentence --warm --reps 3

affinity_turns' rewriting client, twice over: an agent and a sub-agent with the same
system prompt (the same tools), their requests alternating (agent turn 1, sub-agent turn 1,
agent turn 2, ...), every earlier reply sent back rewritten (--rewrite: its first half, or
its first sentence). --named puts both under one session_id (as Claude Code and opencode
do); --warm runs the agent's conversation once before, on each arm, so its parked state
competes with the agent's own (a client that restarted, or replays a conversation). The
affinity-on engine (every tier) and the affinity-off engine (the prefix tiers and the
longest prefix) run the same requests, alternating which arm goes first. TTFT is
engine-side (plan + check-out + prefill + first token); with --reps, each rep runs on
fresh engines and TTFT cells are per-request medians (the token counts are the same every
rep). Per request and arm: tokens reused and primed, the bytes a fork copied, TTFT, and
the pick's reason and cost (memrad.protocol.Decision.render_cost). --control makes both
arms affinity off: an A/A run, what the harness reads between identical engines, to read
before on/off. The last lines sum TTFT and primed tokens per arm, name the worst on/off ratio, and count the requests where on
reused fewer tokens than off or picked another resume.
"""

from __future__ import annotations

import re
import statistics

from memrad.bench.affinity_turns import SYSTEM, TOOL_OUTPUT, client_arguments, client_setup
from memrad.bench.scenarios import REWRITES
from memrad.engine.build import engine_for, in_process
from memrad.request import Completion, GenerationRequest, Identity, SamplingParams

TASKS = ("Step {turn}. Tool result:\n{tool}\nWhat next?",
         "Sub-task {turn}: check the handlers for missing retries. Tool result:\n{tool}\nReport briefly.")
CLIENT_REWRITES = {"half": REWRITES["half"],
                   "first-sentence": lambda reply: re.match(r"\s*[^.!?\n]*[.!?]?", reply).group(0)}
ARMS = ("on", "off")


def run(loaded, args, threads: int, identity: Identity | None, system: str = SYSTEM,
        tool: str = TOOL_OUTPUT, rep: int = 0) -> list[dict]:
    """Both arms over the interleaved requests on fresh engines: one row per request. Which
    arm goes first alternates per request and flips with `rep`, and so does which engine is made
    first (an A/A run, both arms affinity off, read the first-made engine 5% slower summed)."""
    arms = {arm: engine_for(loaded, in_process(args.chunk, args.mode, 64,
                                               affinity=arm == "on" and not getattr(args, "control", False)), threads)
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1])}
    arms["on"].init_worker_thread()
    rewrite = CLIENT_REWRITES[getattr(args, "rewrite", "half")]

    def send(arm: str, messages: list[dict], request_id: str) -> Completion:
        engine = arms[arm]
        text, ids = engine.chat.render(messages, None)
        request = GenerationRequest(request_id, engine.model_id, tuple(ids), text,
                                    SamplingParams(temperature=0.0, max_tokens=args.max_tokens), identity=identity)
        done = engine.generate(request, lambda _: None, lambda: False)
        messages.append({"role": "assistant", "content": rewrite(done.text)})
        return done

    if getattr(args, "warm", False):  # the agent's conversation, once before, on each arm
        for arm in ARMS:
            earlier = [{"role": "system", "content": system}]
            for turn in range(1, args.turns + 1):
                earlier.append({"role": "user", "content": TASKS[0].format(turn=turn, tool=tool)})
                send(arm, earlier, f"{arm}-earlier-{turn}")
    histories = {(arm, who): [{"role": "system", "content": system}] for arm in ARMS for who in (0, 1)}
    rows = []
    for turn in range(1, args.turns + 1):
        for who in (0, 1):
            done = {}
            for arm in (ARMS if (turn + who + rep) % 2 else ARMS[::-1]):
                messages = histories[arm, who]
                messages.append({"role": "user", "content": TASKS[who].format(turn=turn, tool=tool)})
                done[arm] = send(arm, messages, f"{arm}-{who}-{turn}")
            rows.append(dict(who=("agent", "sub-agent")[who], turn=turn, **done))
    return rows


def same_pick(on: Completion, off: Completion) -> bool:
    """Both arms resumed the same way: the same checkpoint, forking or not, copying as much."""
    a, b = on.decision, off.decision
    return (a.checkpoint, a.copied_rows, "forked" in a.reason) == (b.checkpoint, b.copied_rows, "forked" in b.reason)


def _mib(decision) -> str:
    return "-" if decision.copied_bytes is None else f"{decision.copied_bytes / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = client_arguments(__doc__.splitlines()[0], turns=6, max_tokens=32)
    parser.add_argument("--reps", type=int, default=1, help="whole runs on fresh engines; per-request medians")
    parser.add_argument("--rewrite", choices=sorted(CLIENT_REWRITES), default="half",
                        help="what the client keeps of each earlier reply")
    parser.add_argument("--warm", action="store_true", help="run the agent's conversation once before")
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: the 'on' arm with affinity off too (what the harness reads between "
                             "identical engines)")
    args = parser.parse_args(argv)
    loaded, threads, identity, header = client_setup(args)
    control = " control=A/A (both arms affinity off)" if args.control else ""
    print(f"{header} reps={args.reps} rewrite={args.rewrite} warm={args.warm}{control} (per-request median TTFT)\n")
    runs = [run(loaded, args, threads, identity, rep=rep) for rep in range(args.reps)]
    print("| conversation | turn | prompt | reused on / off | primed on / off | copied MiB on / off "
          "| TTFT s on / off | on/off | same pick | on: decision; cost (rep 0) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    sums, ratios = {arm: 0.0 for arm in ARMS}, []
    for rows in zip(*runs):
        r = rows[0]
        on, off = r["on"], r["off"]
        ttft = {arm: statistics.median(x[arm].ttft_s for x in rows) for arm in ARMS}
        for arm in ARMS:
            sums[arm] += ttft[arm]
        ratios.append((ttft["on"] / ttft["off"], f"{r['who']} {r['turn']}"))
        same = all(x["on"].text == x["off"].text == on.text for x in rows)
        pick = "yes" if same_pick(on, off) else f"no: off {off.decision.render()}"
        print(f"| {r['who']} | {r['turn']} | {on.prompt_tokens:,} | {on.cached_tokens:,} / {off.cached_tokens:,} | "
              f"{on.decision.primed_tokens:,} / {off.decision.primed_tokens:,} | {_mib(on.decision)} / "
              f"{_mib(off.decision)} | {ttft['on']:.3f} / {ttft['off']:.3f} | {ratios[-1][0]:.2f}x | {pick} | "
              f"{on.decision.render()}; {on.decision.render_cost()}{'' if same else ' (texts differ)'} |", flush=True)
    rows = runs[0]
    primed = {arm: sum(r[arm].prompt_tokens - r[arm].cached_tokens for r in rows) for arm in ARMS}
    fewer = sum(r["on"].cached_tokens < r["off"].cached_tokens for r in rows)
    other = sum(not same_pick(r["on"], r["off"]) for r in rows)
    worst = max(ratios)
    print(f"\nsummed TTFT over {len(rows)} requests (medians): affinity on {sums['on']:.2f} s, off {sums['off']:.2f} s "
          f"(on/off {sums['on'] / sums['off']:.3f}x); worst request on/off {worst[0]:.2f}x ({worst[1]}); tokens primed: "
          f"on {primed['on']:,}, off {primed['off']:,}; requests where on reused fewer tokens than off: {fewer}; "
          f"picked another resume: {other}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
