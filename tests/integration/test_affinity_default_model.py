"""Session affinity on the default model: a client that rewrites every earlier reply."""

import pytest

from memrad.engine.engine import Engine, EngineOptions
from memrad.request import GenerationRequest, Identity, SamplingParams
from memrad.reuse.pool import ReusePool
from test_reuse_default_model import CHUNK, SYSTEM, exact_resume

pytestmark = pytest.mark.integration

QUESTIONS = ["List the files in the repository root.", "Open README.md and summarise it.",
             "Which module parses the config file?", "Add a test for a missing config file."]


def run_conversation(engine, identity):
    """Each earlier reply goes back with its second half cut, as a reasoning-stripping client does."""
    messages, rows = [SYSTEM], []
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        text, ids = engine.chat.render(messages, None)
        request = GenerationRequest(f"t{turn}", engine.model_id, tuple(ids), text,
                                    SamplingParams(temperature=0.0, max_tokens=24), identity=identity)
        completion = engine.generate(request, lambda _: None, lambda: False)
        rows.append(completion)
        messages.append({"role": "assistant", "content": completion.text[: len(completion.text) // 2]})
    return rows


@pytest.mark.parametrize("identity", [Identity("agent-7", "session_id"), None], ids=["named", "implicit"])
def test_a_rewriting_client_resumes_every_turn_and_matches_the_affinity_off_arm(smol, identity):
    on = run_conversation(Engine(smol, EngineOptions(CHUNK, 2, "exact", affinity=True), ReusePool(8, 2**31)), identity)
    off = run_conversation(Engine(smol, EngineOptions(CHUNK, 2, "exact", affinity=False, longest_prefix=False),
                                  ReusePool(8, 2**31)), identity)
    first_nominated = 1 if identity is not None else 2  # implicit needs 3 shared segments
    for turn, (a, b) in enumerate(zip(on, off)):
        assert a.text == b.text, f"turn {turn + 1} differs between arms"
        assert b.cached_tokens == 0, b.decision.render()
        if turn >= 1:
            # turn 2 of an unnamed client: no nomination, but the longest prefix covers the
            # system prompt, the first question and its reply header
            resume = exact_resume(on[turn - 1].prompt_tokens)
            tier = "affinity" if turn >= first_nominated else "prefix"
            assert a.decision.outcome == "resumed" and a.decision.tier == tier, a.decision.render()
            assert a.cached_tokens == resume and a.decision.primed_tokens == a.prompt_tokens - resume
            if tier == "affinity":
                assert a.decision.nomination == ("explicit" if identity else "implicit")
    assert on[-1].prompt_tokens > on[0].prompt_tokens
