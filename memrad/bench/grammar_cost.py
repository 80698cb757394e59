"""`memrad bench speed --grammar`: what constrained decoding costs a decode step.

Arms on one loaded model, interleaved (order reversed every rep), at each --decode-at context
(one prefill of the longest; each context's reps run before the next, shorter one):
unconstrained, a JSON-schema grammar (structured outputs) and a tool-call grammar
(tool_choice required), each grammar also with its mask computed ahead ("overlapped": token t
accepted and step t+1's mask computed on a worker thread while step t+1's forward runs, the
overlap the issue proposes; llguidance releases the GIL). Every step is what a request's step
runs: the decode step, the Shaper (the grammar's mask; nothing for the unconstrained arm),
sampling, then the token is accepted. The token fed back is the next one of a reply valid
under that arm's grammar, the same number of steps for every arm, so the arms differ only in
the mask's work.

Besides tok/s (steps over wall time: on a shared machine the load swings it by tens of
percent between arms), each cell reports the median step and the median time the Shaper
spent inside it, measured in the same steps: their ratio is what a grammar costs a step.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from memrad.chat.grammar import json_constraint
from memrad.engine.forward import crop_to
from memrad.engine.sampling import Shaper, make_generator, sample
from memrad.engine.timing import Arm
from memrad.request import Constraint, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "summary": {"type": "string"}}, "required": ["title", "year", "tags", "summary"]}
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
             "required": ["path", "content"]}}},
         {"type": "function", "function": {"name": "read_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
PROSE = ("The cache keeps every parked conversation warm, so a rewritten turn resumes from its last exact "
         "checkpoint instead of priming the whole history again. ") * 8


def replies() -> dict[str, str]:
    """Each arm's reply text: valid under its grammar, longer than any --decode-steps."""
    document = json.dumps({"title": "Parking", "year": 2026, "tags": ["cache", "agents"], "summary": PROSE})
    call = 'write_file", "arguments": ' + json.dumps({"path": "docs/notes.md", "content": PROSE}) + "}\n</tool_call>"
    return {"unconstrained": PROSE, "json schema": document, "tool call": call}


OVERLAPPED = " overlapped"


@dataclass
class _Cell:
    """One arm's figures at one context, over the counted reps."""

    rates: list[float] = field(default_factory=list)  # tok/s
    step_ms: list[float] = field(default_factory=list)  # every counted step's wall time
    shaping_ms: list[float] = field(default_factory=list)  # every counted step's Shaper time (critical path)


def run(arm: Arm, decode_at: Sequence[int], steps: int, reps: int) -> None:
    chat = arm.engine.chat
    grammars: dict[str, Constraint | None] = {
        "unconstrained": None, "json schema": json_constraint(SCHEMA, "bench"),
        "tool call": chat.tool_constraint(TOOLS, "required", None, True)}
    texts = replies()
    tokens = {name: chat.encode(text) for name, text in texts.items()}
    assert all(len(ids) >= steps for ids in tokens.values()), "a reply shorter than --decode-steps"
    for name, constraint in grammars.items():  # compile once: what the cache saves every later request
        if constraint is not None:
            started = time.perf_counter()
            assert chat.grammar_error(constraint) is None
            print(f"{name}: first compile {1000 * (time.perf_counter() - started):.1f} ms", flush=True)
    names = ["unconstrained", "json schema", "json schema" + OVERLAPPED, "tool call", "tool call" + OVERLAPPED]
    rng = random.Random(0)
    context = [rng.randrange(3, chat.vocab_size) for _ in range(max(decode_at))]
    cells = {name: {at: _Cell() for at in decode_at} for name in names}
    started = time.perf_counter()
    cache, _ = arm.prefill_marks(context, [])  # once: every arm crops back to `at`, longest first
    print(f"prefill {max(decode_at)} in {time.perf_counter() - started:.1f} s", flush=True)
    with ThreadPoolExecutor(1, thread_name_prefix="mask") as ahead:
        for at in sorted(decode_at, reverse=True):
            for rep in range(reps + 1):  # rep 0 warms up and is not counted
                for name in names if rep % 2 == 0 else reversed(names):
                    base = name.removesuffix(OVERLAPPED)
                    rate, step_ms, shaping_ms = _decode(arm, cache, at, steps, grammars[base], tokens[base],
                                                        ahead if name.endswith(OVERLAPPED) else None)
                    if rep:
                        cell = cells[name][at]
                        cell.rates.append(rate)
                        cell.step_ms += step_ms
                        cell.shaping_ms += shaping_ms
                print(f"at {at}: rep {rep}/{reps} done" + (" (warm-up)" if rep == 0 else ""), flush=True)
    _report(cells, names, sorted(decode_at), steps, reps)


def _report(cells: dict[str, dict[int, _Cell]], names: list[str], decode_at: list[int], steps: int,
            reps: int) -> None:
    median = statistics.median
    print(f"\n| arm ({steps} steps x {reps} reps) | " + " | ".join(
        f"tok/s at {at} | step ms at {at} | Shaper ms at {at}" for at in decode_at) + " |")
    print("| --- |" + " --- | --- | --- |" * len(decode_at))
    for name in names:
        row = []
        for at in decode_at:
            cell, base = cells[name][at], cells["unconstrained"][at]
            rate, step = median(cell.rates), median(cell.step_ms)
            vs = "" if name == "unconstrained" else f" ({rate / median(base.rates) - 1:+.1%})"
            share = "" if name == "unconstrained" else f" ({median(cell.shaping_ms) / median(base.step_ms):.1%} of a step)"
            row.append(f"{rate:.1f}{vs} | {step:.2f} | {median(cell.shaping_ms):.3f}{share}")
        print(f"| {name} | " + " | ".join(row) + " |")


def _decode(arm: Arm, cache: object, at: int, steps: int, constraint: Constraint | None, reply: list[int],
            ahead: ThreadPoolExecutor | None) -> tuple[float, list[float], list[float]]:
    """(tok/s, each step's ms, each step's ms on the critical path in the Shaper) of `steps`
    steps after `at`; `ahead`: the worker that accepts each token and computes the next mask
    while the step's forward runs."""
    chat = arm.engine.chat
    params = SamplingParams(temperature=0.0, constraint=constraint)
    crop_to(cache, at)
    token, shaper, pending = 5, None, None
    generator = make_generator(0)
    step_ms, shaping_ms = [], []
    started = time.perf_counter()
    for i in range(steps):
        began = time.perf_counter()
        if shaper is not None and ahead is not None:
            pending = ahead.submit(_accept_and_mask, shaper, token)
        logits = arm.feed(cache, token, at + i)
        shaping = time.perf_counter()
        if shaper is None and constraint is not None:
            shaper = Shaper(params, (), logits.numel(), arm.loaded.eos_ids, chat.grammars.matcher(constraint))
        shaped = logits if shaper is None else shaper(logits, pending.result() if pending is not None else None)
        shaping_s = time.perf_counter() - shaping
        sample(shaped, params, generator)
        token = reply[i]
        if shaper is not None and ahead is None:
            accepting = time.perf_counter()
            shaper.accept(token)
            shaping_s += time.perf_counter() - accepting
        step_ms.append(1000 * (time.perf_counter() - began))
        shaping_ms.append(1000 * shaping_s)
    rate = steps / (time.perf_counter() - started)
    crop_to(cache, at)
    return rate, step_ms, shaping_ms


def _accept_and_mask(shaper: Shaper, token: int):
    """On the worker: the token chosen at step t, then the mask for step t + 1."""
    shaper.accept(token)
    return shaper.allowed_tokens(shaper.counts.size)
