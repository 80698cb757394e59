"""Sharing across conversations on the default model: a long shared system prompt is forked,
not re-primed, and the conversation it came from resumes as if nothing had happened."""

import pytest
import torch

from memrad.reuse.prefix_index import common_prefix_len
from test_reuse_default_model import CHUNK, TOOLS, ask, engine_for

pytestmark = pytest.mark.integration

# A 1k+-token system prompt with a tool list, as agent clients send on every conversation.
LONG_SYSTEM = {"role": "system", "content": (
    "You are a careful coding agent working in a Python repository. Think step by step, read before "
    "you write, keep changes small, and run the tests after every change. You can call these tools:\n"
    + "\n".join([TOOLS] * 6) + "\nAnswer briefly and precisely.")}


def test_a_new_conversation_reuses_a_parked_1k_system_prompt_and_the_source_still_resumes(smol):
    engine, alone = engine_for(smol, "exact"), engine_for(smol, "exact")
    a_first = [LONG_SYSTEM, {"role": "user", "content": "List the files in the repository root."}]
    a1, _ = ask(engine, a_first, "a1")
    ask(alone, a_first, "a1")
    system_tokens = len(engine.chat.render([LONG_SYSTEM], None)[1])
    assert system_tokens >= 1024, "a 1k-token system prompt"

    b_first = [LONG_SYSTEM, {"role": "user", "content": "Run the test suite and report failures."}]
    b1, b_state = ask(engine, b_first, "b1")
    b_cold, b_cold_state = ask(engine, b_first, "b1-cold", salt="cold")
    shared = common_prefix_len(engine.chat.render(a_first, None)[1], engine.chat.render(b_first, None)[1])
    reused = shared - shared % CHUNK  # the last grid cut inside the shared system prompt
    assert b1.decision.render() == (f"prefix: resumed (longest prefix with s1, {reused:,} of {b1.prompt_tokens:,}; "
                                    "forked)")
    assert b1.cached_tokens == reused >= 1000
    assert torch.equal(b_state.prompt_logits, b_cold_state.prompt_logits) and b1.text == b_cold.text

    a_second = a_first + [{"role": "assistant", "content": a1.text},
                          {"role": "user", "content": "Now open README.md."}]
    a2, a2_state = ask(engine, a_second, "a2")
    a2_alone, a2_alone_state = ask(alone, a_second, "a2")
    assert a2.decision.candidate == "s1" and a2.cached_tokens == a1.prompt_tokens == a2_alone.cached_tokens
    assert torch.equal(a2_state.prompt_logits, a2_alone_state.prompt_logits) and a2.text == a2_alone.text
