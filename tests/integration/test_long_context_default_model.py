"""The default model served past its native 8,192 tokens (yarn x4 to 32,768): a resumed turn
whose prompt runs past the native length equals its cold run bit for bit, in the bf16 the
daemon picks on this CPU, through the engine the daemon builds (with memra's prefill attention
kernel where auto takes it: AMX, fp32 FMA tiles; SDPA on the bf16 vector paths: memrad.engine.model.attention).

The length: an agent CLI's first request, ~20k tokens (Claude Code's with its default tools:
20,326). The test primes 20k cold twice (the first turn, and the second turn's cold rerun);
docs/BENCHMARKS.md#the-prefill-attention-kernel has the time it took."""

import pytest

import stories
from memrad.engine.kernels import prefill_attention
from memrad.engine.model import attention

pytestmark = pytest.mark.integration

CHUNK = 256
FILES = "\n".join(f"src/module_{i:03d}.py: defines helper_{i}(x) and class Widget{i}; see tests/test_{i:03d}.py"
                  for i in range(540))




def test_a_resumed_turn_at_20k_tokens_equals_its_cold_run(smol_served):
    assert (smol_served.context_len, smol_served.context.describe()) == (32768, "yarn x4")
    declined = prefill_attention.path(smol_served.model.dtype) in attention._AUTO_DECLINES  # bf16 off AMX: SDPA
    assert smol_served.attention.value == ("torch" if declined else "memra"), smol_served.attention.reason
    engine = stories.make_engine(smol_served, CHUNK, 2, max_sessions=4, max_bytes=2**32)
    first_turn = [{"role": "system", "content": "You are a coding agent. The repository:\n" + FILES},
                  {"role": "user", "content": "Which module defines helper_7?"}]
    first = stories.assert_second_turn_resumes_as_cold(engine, first_turn, "And which test covers it?")
    assert first.prompt_tokens == 20330  # an agent CLI's first request, 2.5x the native 8,192
