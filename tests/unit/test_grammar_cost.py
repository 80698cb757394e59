"""`memrad bench speed --grammar` (memrad.bench.grammar_cost) on the tiny model: every arm at
every context, the mask computed ahead gives the same tokens' masks as the one computed in line."""

from __future__ import annotations

import numpy as np

from memrad.bench import grammar_cost
from memrad.chat.grammar import json_constraint
from memrad.engine.sampling import Shaper
from memrad.engine.timing import Arm
from memrad.request import SamplingParams


def test_the_grammar_bench_prints_every_arm_at_every_context(tiny_loaded, capsys):
    grammar_cost.run(Arm("tiny", tiny_loaded, 16, 1, "eager"), [32, 64], steps=6, reps=1)
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0] == ("| arm (6 steps x 1 reps) | tok/s at 32 | step ms at 32 | Shaper ms at 32 | tok/s at 64 "
                        "| step ms at 64 | Shaper ms at 64 |")
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| unconstrained", "| json schema", "| json schema overlapped", "| tool call", "| tool call overlapped"]
    assert all(row.count(" of a step)") == 2 for row in table[3:])
    assert "json schema: first compile" in out and "at 32: rep 1/1 done" in out


def test_a_mask_computed_ahead_on_the_worker_is_the_one_computed_in_line(tiny_loaded):
    chat = tiny_loaded.tokenizer
    from memrad.chat.grammar import Grammars

    grammars = Grammars(chat)
    constraint = json_constraint(grammar_cost.SCHEMA, "bench")
    reply = chat.encode(grammar_cost.replies()["json schema"], add_special_tokens=False)[:20]
    params = SamplingParams(temperature=0.0, constraint=constraint)
    inline, ahead = (Shaper(params, (), len(chat), tiny_loaded.eos_ids, grammars.matcher(constraint)) for _ in range(2))
    for token in reply:
        inline.accept(token)
        assert np.array_equal(grammar_cost._accept_and_mask(ahead, token), inline.allowed_tokens(len(chat)))
