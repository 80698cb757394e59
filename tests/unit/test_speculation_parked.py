"""The drafts' index is kept with the parked session, so a resumed turn extends it.

An agent's conversation goes on: turn 2 sends turn 1's prompt, the reply, and a new message. The
reply of turn 1 drafted from an index over its prompt and its own tokens; that index is parked
with the session (over exactly its tokens), and turn 2, resuming the session, cuts it back to what
it shares with the new prompt and indexes only the rest. At every draft it equals the index built
from scratch, so the drafts, and the reply, are those of a cold run of turn 2. A sibling that forks
the session builds its own and leaves the source's as it was; a session written to the disk tier
keeps no index (a resume from disk indexes its prompt anew).
"""

import pytest

from memrad.engine.state.disk import DiskTier, state_format
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse import drafts
from memrad.reuse.drafts import DraftIndex
from stories import make_engine, recording, run_together

CHUNK = 16
FILE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"


def turn1():
    return [{"role": "system", "content": "You rewrite files."},
            {"role": "user", "content": f"{FILE}\nRename width to w."}]


def turn2(reply):
    return turn1() + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now height to h."}]


def sibling():
    return [{"role": "system", "content": "You rewrite files."},
            {"role": "user", "content": f"{FILE}\nRename height to h."}]


def run(engine, messages, rid):
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest(rid, engine.model_id, tuple(ids), text,
                                SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))
    completion, state, scores = run_together(engine, [request])[rid]
    return completion, state, scores


@pytest.fixture
def lookups(monkeypatch):
    """Every draft lookup: whether the index equalled the one built from scratch over its tokens."""
    seen = []
    locate = DraftIndex.locate

    def checked(self):
        seen.append((id(self), list(self.tokens), self == DraftIndex(self.tokens)))
        return locate(self)

    monkeypatch.setattr(drafts.DraftIndex, "locate", checked)
    return seen


def test_a_resumed_turn_extends_the_parked_index_and_drafts_as_a_cold_run(q4_bf16, lookups):
    engine = recording(make_engine(q4_bf16, CHUNK, speculate="auto"))
    first, state1, _ = run(engine, turn1(), "t1")
    parked = state1.session.drafts
    assert first.speculation.verify_steps > 0  # the reply drafted, so it built an index
    assert parked == DraftIndex(state1.session.token_ids)  # over exactly the tokens parked

    lookups.clear()
    second, state2, scores2 = run(engine, turn2(first.text), "t2")
    assert second.decision.outcome == "resumed" and second.cached_tokens > 0
    assert state2.session.drafts is parked  # extended in place, not rebuilt
    assert state2.session.drafts == DraftIndex(state2.session.token_ids)
    prompt2 = list(state2.request.prompt_ids)
    assert lookups and all(same and tokens[: len(prompt2)] == prompt2 and key == id(parked)
                           for key, tokens, same in lookups)

    cold = recording(make_engine(q4_bf16, CHUNK, speculate="auto"))
    alone, _, scores_cold = run(cold, turn2(first.text), "t2")
    assert alone.decision.outcome == "cold"
    assert (second.text, second.completion_tokens, second.speculation) == (
        alone.text, alone.completion_tokens, alone.speculation)  # the same drafts, accepted alike
    assert [lp.logprob for lp in second.logprobs] == [lp.logprob for lp in alone.logprobs]


def test_a_fork_builds_its_own_index_and_leaves_the_source_index_alone(q4_bf16, lookups):
    engine = recording(make_engine(q4_bf16, CHUNK, speculate="auto"))
    _, state1, _ = run(engine, turn1(), "t1")
    source = state1.session
    lookups.clear()
    forked, state2, _ = run(engine, sibling(), "side")
    assert forked.decision.outcome == "resumed" and "forked" in forked.decision.reason
    assert engine.parking.get(source.session_id).drafts == DraftIndex(source.token_ids)  # unchanged
    assert lookups and all(same and key != id(source.drafts) for key, _, same in lookups)
    assert state2.session.drafts == DraftIndex(state2.session.token_ids)


def test_the_disk_tier_keeps_no_index_and_a_resume_from_it_indexes_anew(q4_bf16, lookups, tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, state_format(q4_bf16, CHUNK, "exact"))
    engine = recording(make_engine(q4_bf16, CHUNK, speculate="auto", disk=disk))
    first, state1, _ = run(engine, turn1(), "t1")
    engine.parking.spill_all()
    on_disk = disk.pool.get(state1.session.session_id)
    assert on_disk is not None and on_disk.drafts is None
    lookups.clear()
    second, state2, _ = run(engine, turn2(first.text), "t2")
    assert second.decision.outcome == "resumed" and second.decision.tier != "live"
    assert lookups and all(same for _, _, same in lookups)
    assert state2.session.drafts == DraftIndex(state2.session.token_ids)
