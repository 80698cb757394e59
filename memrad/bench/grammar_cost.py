"""`memrad bench speed --grammar`: what constrained decoding costs a decode step.

Three arms on one loaded model, interleaved (order reversed every rep), at each --decode-at
context: unconstrained, a JSON-schema grammar (structured outputs) and a tool-call grammar
(tool_choice required). Every step is what a request's step runs: the decode step, the
Shaper (the grammar's mask; nothing for the unconstrained arm), sampling, then the token is
accepted. The token fed back is the next one of a reply valid under that arm's grammar, the
same number of steps for every arm, so the arms differ only in the mask's work.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence

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


def run(arm: Arm, decode_at: Sequence[int], steps: int, reps: int) -> None:
    chat = arm.engine.chat
    constraints: dict[str, Constraint | None] = {
        "unconstrained": None, "json schema": json_constraint(SCHEMA, "bench"),
        "tool call": chat.tool_constraint(TOOLS, "required", None, True)}
    texts = replies()
    tokens = {name: chat.encode(text) for name, text in texts.items()}
    assert all(len(ids) >= steps for ids in tokens.values()), "a reply shorter than --decode-steps"
    for name, constraint in constraints.items():  # compile once: what the cache saves every later request
        if constraint is not None:
            started = time.perf_counter()
            assert chat.grammar_error(constraint) is None
            print(f"{name}: first compile {1000 * (time.perf_counter() - started):.1f} ms", flush=True)
    rng = random.Random(0)
    context = [rng.randrange(3, chat.vocab_size) for _ in range(max(decode_at))]
    cells: dict[str, dict[int, list[float]]] = {name: {at: [] for at in decode_at} for name in constraints}
    shaping: dict[str, list[float]] = {name: [] for name in constraints}  # ms per step in the Shaper
    names = list(constraints)
    for rep in range(reps + 1):  # rep 0 warms up and is not counted
        cache, _ = arm.prefill_marks(context, [])
        for at in sorted(decode_at, reverse=True):  # each arm crops back to `at`: longest first
            for name in names if rep % 2 == 0 else reversed(names):
                rate, shaping_ms = _decode_rate(arm, cache, at, steps, constraints[name], tokens[name])
                if rep:
                    cells[name][at].append(rate)
                    shaping[name].append(shaping_ms)
        print(f"rep {rep}/{reps} done" + (" (warm-up)" if rep == 0 else ""), flush=True)
    print(f"\n| decode tok/s ({steps} steps, median of {reps}) | " + " | ".join(f"at {at}" for at in sorted(decode_at))
          + " | mask + accept ms/step |\n| --- |" + " --- |" * (len(decode_at) + 1))
    base = {at: statistics.median(cells["unconstrained"][at]) for at in decode_at}
    for name in names:
        row = []
        for at in sorted(decode_at):
            got = statistics.median(cells[name][at])
            row.append(f"{got:.1f}" + ("" if name == "unconstrained" else f" ({got / base[at] - 1:+.1%})"))
        print(f"| {name} | " + " | ".join(row) + f" | {statistics.median(shaping[name]):.3f} |")


def _decode_rate(arm: Arm, cache: object, at: int, steps: int, constraint: Constraint | None,
                 reply: list[int]) -> tuple[float, float]:
    """(decode tok/s, ms per step spent shaping and accepting) of `steps` steps after `at`."""
    chat = arm.engine.chat
    params = SamplingParams(temperature=0.0, constraint=constraint)
    crop_to(cache, at)
    token, shaper = 5, None
    generator = make_generator(0)
    shaping_s = 0.0
    started = time.perf_counter()
    for i in range(steps):
        logits = arm.feed(cache, token, at + i)
        began = time.perf_counter()
        if shaper is None and constraint is not None:
            shaper = Shaper(params, (), logits.numel(), arm.loaded.eos_ids, chat.grammars.matcher(constraint))
        shaped = logits if shaper is None else shaper(logits)
        shaping_s += time.perf_counter() - began
        sample(shaped, params, generator)
        token = reply[i]
        began = time.perf_counter()
        if shaper is not None:
            shaper.accept(token)
        shaping_s += time.perf_counter() - began
    rate = steps / (time.perf_counter() - started)
    crop_to(cache, at)
    return rate, 1000 * shaping_s / steps
