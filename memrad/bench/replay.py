"""`memrad bench replay TRANSCRIPT --out DIR`: the same bytes under three arms.

Starts a fresh daemon per arm and rep, interleaving the arms (rotated each rep):
  both      affinity and the longest-prefix tier (the defaults)
  affinity  affinity only (MEMRA_LONGEST_PREFIX=0)
  neither   MEMRA_AFFINITY=0 MEMRA_LONGEST_PREFIX=0: the plain prefix probes (the baseline)
so what each mechanism buys is measured, not assumed. It streams every recorded turn and stops the TTFT clock
at the first SSE chunk that carries text. Writes DIR/rows.jsonl (every turn of every run),
DIR/logs/, DIR/ttft.png (with the `bench` extra), and DIR/RESULTS.md: per-turn medians
over reps, the table by turn class
(classified from the request bodies: cold prime, pure extension, rewritten history),
sums of per-turn medians, wall clock, and output byte-identity across and within arms.
Fails when no turn rewrote its history: a run cannot claim a regime it did not reproduce.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from memrad.bench.daemons import Daemon
from memrad.bench.plot import plot_ttft

ARMS = {"both": {}, "affinity": {"MEMRA_LONGEST_PREFIX": "0"},
        "neither": {"MEMRA_AFFINITY": "0", "MEMRA_LONGEST_PREFIX": "0"}}
ON, OFF = "both", "neither"  # the arms the targets compare


def classify(turns: list[dict]) -> list[str]:
    """Per turn, from the bodies: does it extend the previous request + its reply verbatim?"""
    classes = []
    for i, turn in enumerate(turns):
        if i == 0:
            classes.append("cold prime")
            continue
        prev, now = turns[i - 1]["body"]["messages"], turn["body"]["messages"]
        extended = prev + [{"role": "assistant", "content": turns[i - 1]["reply"]}]
        classes.append("pure extension" if now[: len(extended)] == extended else "rewritten history")
    return classes


@dataclass(frozen=True, slots=True)
class Row:
    arm: str
    rep: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    decision: str
    text: str


def stream_turn(client, body: dict) -> tuple[float, int, int, str, str]:
    """(ttft_s, prompt tokens, cached tokens, decision, text) of one streamed request."""
    extra = {k: body[k] for k in ("session_id",) if k in body}
    started = time.perf_counter()
    ttft, parts, usage = None, [], None
    with client.chat.completions.with_streaming_response.create(
            model=body["model"], messages=body["messages"], temperature=body["temperature"],
            max_tokens=body["max_tokens"], stream=True, stream_options={"include_usage": True},
            extra_body=extra or None) as response:
        decision = response.headers.get("x-memra-decision", "")
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    return (ttft if ttft is not None else time.perf_counter() - started, usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens, decision, "".join(parts))


def run_arm(arm: str, rep: int, transcript: dict, flags: list[str], logs: Path) -> tuple[list[Row], float]:
    import openai

    daemon = Daemon.create(ARMS[arm])
    daemon.start(*flags)
    started = time.perf_counter()
    rows = []
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        for i, turn in enumerate(transcript["turns"], start=1):
            ttft, prompt, cached, decision, text = stream_turn(client, turn["body"])
            rows.append(Row(arm, rep, i, ttft, prompt, cached, decision, text))
            print(f"  {arm} rep {rep} turn {i}: {prompt} tokens, ttft {ttft:.3f}s, cached {cached}", flush=True)
    finally:
        wall = time.perf_counter() - started
        daemon.stop()
        if daemon.log_path.exists():
            shutil.copy(daemon.log_path, logs / f"{arm}-rep{rep}.log")
    return rows, wall


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(transcript: dict, rows: list[Row], walls: dict[str, list[float]], reps: int,
           flags: tuple[str, ...] = ()) -> tuple[str, bool]:
    """RESULTS.md, and whether the run reproduced a rewritten history at all."""
    classes = classify(transcript["turns"])
    n = len(classes)
    arms = [arm for arm in ARMS if any(r.arm == arm for r in rows)]
    median = {arm: [statistics.median(r.ttft_s for r in rows if r.arm == arm and r.turn == t)
                    for t in range(1, n + 1)] for arm in arms}
    cached = {(r.arm, r.turn): r.cached_tokens for r in rows if r.rep == 0}
    prompt = {r.turn: r.prompt_tokens for r in rows if r.arm == ON and r.rep == 0}
    head = " | ".join(f"{arm}: sum of medians s" for arm in arms)
    lines = [f"# Replay of {transcript['scenario']} (client rewrite: {transcript['rewrite']}; "
             f"{'named' if transcript.get('session_id') else 'unnamed'} client)", "",
             f"{reps} reps per arm, interleaved; TTFT = first SSE chunk with text, client side; per-turn medians. "
             f"Arms: {', '.join(arms)} (see `memrad bench replay --help`). "
             f"Daemon flags: {' '.join(flags) or 'none (defaults: exact mode)'}.",
             "", f"| turn class | turns | {head} | {OFF}/{ON} |",
             "| --- | ---: |" + " ---: |" * (len(arms) + 1)]
    for cls in ("cold prime", "pure extension", "rewritten history"):
        turns = [t for t in range(n) if classes[t] == cls]
        if turns:
            sums = {arm: sum(median[arm][t] for t in turns) for arm in arms}
            lines.append(f"| {cls} | {len(turns)} | " + " | ".join(f"{sums[a]:.2f}" for a in arms)
                         + f" | {sums[OFF] / sums[ON]:.1f}x |")
    walls_text = ", ".join(f"{arm} {statistics.median(walls[arm]):.1f} s" for arm in arms)
    lines += ["", "Sum of per-turn medians: " + ", ".join(f"{arm} {sum(median[arm]):.2f} s" for arm in arms)
              + f". End-to-end wall clock (median over reps): {walls_text}.", "",
              "| turn | class | prompt tokens | " + " | ".join(f"{arm} TTFT s (cached)" for arm in arms)
              + f" | {OFF}/{ON} | {ON} decision (rep 0) |",
              "| ---: | --- | ---: |" + " ---: |" * (len(arms) + 1) + " --- |"]
    decisions = {r.turn: r.decision for r in rows if r.arm == ON and r.rep == 0}
    for t in range(n):
        cells = " | ".join(f"{median[a][t]:.3f} ({cached.get((a, t + 1), '?')})" for a in arms)
        lines.append(f"| {t + 1} | {classes[t]} | {prompt.get(t + 1, '?')} | {cells} | "
                     f"{median[OFF][t] / median[ON][t]:.1f}x | {decisions.get(t + 1, '')} |")
    text = {(r.arm, r.rep, r.turn): r.text for r in rows}
    diffs = []
    for t in range(1, n + 1):
        pairs = [((ON, 0), (arm, 0)) for arm in arms if arm != ON]
        pairs += [((arm, 0), (arm, k)) for arm in arms for k in range(1, reps)]
        for a, b in pairs:
            at = first_difference(text[(*a, t)], text[(*b, t)])
            if at is not None:
                diffs.append(f"- turn {t}: {a[0]} rep {a[1]} vs {b[0]} rep {b[1]} differ at character {at}")
    resumed = {r.turn for r in rows if r.arm == ON and r.rep == 0 and r.cached_tokens > 0}
    differing = len({line.split(":")[0] for line in diffs})
    lines += ["", "## Targets", "", *targets(classes, median, prompt, resumed, n - differing)]
    lines += ["", "## Output byte-identity", ""]
    lines += diffs or [f"All {n} turns byte-identical across arms and within each arm."]
    return "\n".join(lines) + "\n", "rewritten history" in classes


def targets(classes: list[str], median: dict[str, list[float]], prompt: dict[int, int], resumed: set[int],
            identical: int) -> list[str]:
    """The replay issue's three targets, each with the measured value beside it."""
    rewritten = [t for t in range(1, len(classes) + 1) if classes[t - 1] == "rewritten history"]
    out = []
    first = next((t for t in rewritten if t in resumed), None)
    if first is not None:
        last = rewritten[-1]
        on = median[ON]
        out.append(f"- Flat line: last rewritten turn ({last}) {on[last - 1]:.3f} s vs first resumed rewritten turn "
                   f"({first}) {on[first - 1]:.3f} s: {on[last - 1] / on[first - 1]:.2f}x (target <= 1.2x) while "
                   f"the prompt grew {prompt[last] / prompt[first]:.1f}x ({prompt[first]} -> {prompt[last]} tokens).")
    long = [t for t in rewritten if prompt.get(t, 0) > 4000]
    if long:
        ratios = [median[OFF][t - 1] / median[ON][t - 1] for t in long]
        out.append(f"- {OFF}/{ON} past 4k tokens ({len(long)} rewritten turns): {min(ratios):.1f}x to {max(ratios):.1f}x, "
                   f">= 10x on {sum(r >= 10 for r in ratios)} of {len(long)} (target: all).")
    out.append(f"- Byte-identical across arms and reps: {identical} of {len(classes)} turns (target: all, exact mode).")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench replay", description=__doc__.splitlines()[0])
    parser.add_argument("transcript", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.epilog = "Extra `memrad start` flags for both arms go after `--`, e.g. `-- --reuse-mode fast`."
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.flags = flags
    transcript = json.loads(args.transcript.read_text())
    if "rewritten history" not in classify(transcript["turns"]):
        print("FAIL: no turn of this transcript rewrote its history; record with another --rewrite")
        return 1
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    rows, walls = [], {arm: [] for arm in ARMS}
    order = list(ARMS)
    for rep in range(args.reps):
        for arm in order[rep % len(order):] + order[: rep % len(order)]:
            arm_rows, wall = run_arm(arm, rep, transcript, args.flags, args.out / "logs")
            rows += arm_rows
            walls[arm].append(wall)
    with open(args.out / "rows.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(asdict(row)) + "\n")
    text, reproduced = report(transcript, rows, walls, args.reps, tuple(args.flags))
    if plot_ttft([asdict(r) for r in rows], args.out / "ttft.png",
                 f"TTFT per turn: {transcript['scenario']}, {args.reps} reps"):
        text += "\n![TTFT against prompt tokens](ttft.png)\n"
    (args.out / "RESULTS.md").write_text(text)
    print(text)
    return 0 if reproduced else 1
