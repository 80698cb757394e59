"""Affinity on vs off over one conversation whose client rewrites every earlier reply.

    python -m memrad.bench.affinity_turns --turns 10 --reps 3

In process on the default model. Each user turn carries a tool result, so the prompt grows
several-fold; the client sends every earlier reply back with its second half cut (what a
reasoning-stripping client does to a reply). Per turn, the affinity-on engine and the
affinity-off engine (same pool settings; prefix tiers only) run the same request,
alternating which arm goes first (and flipping that order every rep). TTFT is engine-side:
plan + rebuild + prefill + first token. With --reps, each rep is a whole conversation on
fresh engines, and the table holds per-turn medians. --on-only skips the affinity-off arm, so
the on arm has the process to itself (as in a daemon serving one agent) and reps are cheap.

The floor column is the bare model forward of exactly the tokens the affinity-on arm primed,
after exactly the context it reused, chunked the same way, timed right after that arm's
turn on a cache kept alongside (no planning, no pool, no sampling): what the turn costs
the hardware. On a CPU it grows with the context, because attention reads every cached row.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from memrad.engine.build import engine_for, in_process
from memrad.engine.forward import crop_to, prefill
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.grid import find_anchors
from memrad.request import GenerationRequest, Identity, SamplingParams
from memrad.reuse.planner import common_prefix_len

SYSTEM = ("You are a careful coding agent working in a Python repository. Read before you write, keep "
          "changes small, and run the tests after every change. Tools: read_file(path), write_file(path, "
          "text), list_dir(path), grep(pattern), run_tests(), git_diff(). Every tool returns plain text. ") * 4
TOOL_OUTPUT = "\n".join(f"src/module_{i}.py: def handler_{i}(request): return process(request, retries={i})"
                        for i in range(8))


def client_arguments(description: str, turns: int, max_tokens: int) -> argparse.ArgumentParser:
    """The arguments every rewriting-client harness takes (this one, interleaved_turns)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--mode", default="exact")
    parser.add_argument("--named", action="store_true", help="the client sends a session_id")
    return parser


def client_setup(args: argparse.Namespace) -> tuple[object, int, Identity | None, str]:
    """The loaded model, the thread count, the identity and the header line a run prints."""
    threads = resolve_threads(args.threads)
    loaded = load_model(args.model, "auto", "auto")
    identity = Identity("bench", "session_id") if args.named else None
    header = (f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} threads={threads} "
              f"chunk={args.chunk} mode={args.mode} client={'named' if args.named else 'unnamed'} "
              f"max_tokens={args.max_tokens}")
    return loaded, threads, identity, header


def main(argv: list[str] | None = None) -> int:
    parser = client_arguments(__doc__.splitlines()[0], turns=10, max_tokens=48)
    parser.add_argument("--reps", type=int, default=1, help="whole conversations on fresh engines; per-turn medians")
    parser.add_argument("--on-only", action="store_true",
                        help="skip the affinity-off arm: the on arm and its floor alone in the process (cheap reps)")
    args = parser.parse_args(argv)
    loaded, threads, identity, header = client_setup(args)
    print(f"{header} reps={args.reps} (per-turn medians)"
          f"{'; affinity-off arm skipped' if args.on_only else ''}\n")
    runs = []
    for rep in range(args.reps):
        runs.append(conversation(loaded, args, threads, identity, rep))
        print(f"rep {rep}: {' '.join(f'{on.ttft_s:.3f}' for on, _, _ in runs[-1])} (on TTFT s per turn); "
              f"floor {' '.join(f'{floor:.3f}' for _, _, floor in runs[-1])}", flush=True)
    print("\n| turn | prompt tokens | on: cached | on TTFT s | floor s | off TTFT s | off/on | same text "
          "| on decision (rep 0) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    on_medians, floor_medians = [], []
    for turn, rows in enumerate(zip(*runs), start=1):
        on_s = statistics.median(on.ttft_s for on, _, _ in rows)
        floor_s = statistics.median(floor for _, _, floor in rows)
        on_medians.append(on_s)
        floor_medians.append(floor_s)
        on = rows[0][0]
        if args.on_only:
            off_cells = "- | - | -"
        else:
            off_s = statistics.median(off.ttft_s for _, off, _ in rows)
            same = all(on.text == off.text == rows[0][0].text for on, off, _ in rows)
            off_cells = f"{off_s:.3f} | {off_s / on_s:.1f}x | {'yes' if same else 'no'}"
        print(f"| {turn} | {on.prompt_tokens} | {on.cached_tokens} | {on_s:.3f} | {floor_s:.3f} | {off_cells} | "
              f"{on.decision.render()} |", flush=True)
    first = next((t for t, (on, _, _) in enumerate(runs[0], start=1) if on.decision.outcome == "resumed"), None)
    if first is not None:
        last, resumed = runs[0][-1][0], runs[0][first - 1][0]
        print(f"\naffinity on, last turn / first resumed turn ({first}), medians: TTFT "
              f"{on_medians[-1] / on_medians[first - 1]:.2f}x, floor {floor_medians[-1] / floor_medians[first - 1]:.2f}x, "
              f"while the prompt grew {last.prompt_tokens / resumed.prompt_tokens:.1f}x "
              f"({resumed.prompt_tokens} -> {last.prompt_tokens} tokens)")
        per_rep = [rows[-1][0].ttft_s / rows[first - 1][0].ttft_s for rows in runs]
        print(f"per rep: {', '.join(f'{r:.2f}x' for r in per_rep)}")
        if len(runs) >= 5:
            cells = [[(on.ttft_s, floor) for on, _, floor in rows] for rows in runs]
            on_ci, floor_ci = (bootstrap_ratio([[c[k] for c in rep] for rep in cells], first) for k in (0, 1))
            print(f"95% bootstrap intervals over reps: TTFT {on_ci[0]:.2f}x-{on_ci[1]:.2f}x, "
                  f"floor {floor_ci[0]:.2f}x-{floor_ci[1]:.2f}x")
    return 0


def bootstrap_ratio(reps: list[list[float]], first: int, draws: int = 5000) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of median(last turn) / median(turn `first`) over reps
    resampled with replacement (each rep: seconds per turn)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(r[-1] for r in sample) / statistics.median(r[first - 1] for r in sample)
                    for sample in ([rng.choice(reps) for _ in reps] for _ in range(draws)))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def conversation(loaded, args, threads: int, identity: Identity | None, rep: int) -> list[tuple]:
    """One conversation on fresh engines: per turn, (affinity-on, affinity-off) completions
    and the floor of the affinity-on turn in seconds (the off completion is None with --on-only)."""
    arms = {flag: engine_for(loaded, in_process(args.chunk, args.mode, 64, affinity=flag, threads=threads), threads)
            for flag in ((True,) if args.on_only else (True, False))}
    arms[True].init_worker_thread()
    floor = Floor(arms[True])
    messages = {flag: [{"role": "system", "content": SYSTEM}] for flag in arms}
    rows = []
    for turn in range(1, args.turns + 1):
        results = {}
        for flag in ((True, False) if (turn + rep) % 2 else (False, True)):
            if flag not in arms:
                continue
            engine = arms[flag]
            messages[flag].append({"role": "user", "content": f"Step {turn}. Tool result:\n{TOOL_OUTPUT}\nWhat next?"})
            text, ids = engine.chat.render(messages[flag], None)
            request = GenerationRequest(f"{flag}-{turn}", engine.model_id, tuple(ids), text,
                                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                        identity=identity)
            results[flag] = engine.generate(request, lambda _: None, lambda: False)
            if flag:
                floor_s = floor.time(ids, results[flag].cached_tokens)
            reply = results[flag].text
            messages[flag].append({"role": "assistant", "content": reply[: len(reply) // 2]})
        rows.append((results[True], results.get(False), floor_s))
    return rows


class Floor:
    """The bare forward of what an engine primed, on a cache of its own (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cache = engine.new_cache()
        self.ids: list[int] = []  # what self.cache holds

    def time(self, ids: list[int], start: int) -> float:
        """Seconds to prime ids[start:] after ids[:start], as the engine chunks it."""
        engine = self.engine
        model, chunk, exact = engine.loaded.model, engine.prefill_chunk, engine.mode == "exact"
        anchors = find_anchors(ids, engine.reply_header)
        shared = common_prefix_len(tuple(self.ids), tuple(ids[:start]))
        if shared == 0:
            self.cache = engine.new_cache()
        else:
            crop_to(self.cache, shared)
        if shared < start:  # context the cache lacks: untimed
            prefill(model, self.cache, ids[shared:start], shared, chunk, on_grid=exact, anchors=anchors)
        began = time.perf_counter()
        prefill(model, self.cache, ids[start:], start, chunk, on_grid=exact, anchors=anchors)
        self.ids = list(ids)
        return time.perf_counter() - began


if __name__ == "__main__":
    raise SystemExit(main())
