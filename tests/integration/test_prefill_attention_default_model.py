"""The default model with memra's prefill attention kernel serving prefill (its path on this CPU:
AMX, AVX512-BF16 pair dots, or fp32 FMA tiles; MEMRA_KERNEL_ISA=avx2 for the AVX2 one): a resumed
turn equals its cold run bit for bit, in the bf16 the daemon picks here and in fp32.

The first turn spans seven 256-row key blocks, so the resumed suffix's chunks attend a cache that
a cold prefill wrote in other chunks: the kernel's bits must not depend on which run made it.
The long version (a 20k-token first turn, past the native context) is
test_long_context_default_model.py."""

import pytest

import stories
from memrad.engine.kernels import prefill_attention
from memrad.engine.model import attention
from memrad.engine.model.loader import load_model

pytestmark = pytest.mark.integration

CHUNK = 256
FILES = "\n".join(f"src/module_{i:03d}.py: defines helper_{i}(x) and class Widget{i}; see tests/test_{i:03d}.py"
                  for i in range(50))


@pytest.mark.parametrize("fixture", ["smol_served", "smol"])
def test_a_resumed_turn_on_the_kernel_equals_its_cold_run(fixture, request):
    loaded = request.getfixturevalue(fixture)  # auto dtype (bf16 here) / fp32
    path = prefill_attention.path(loaded.model.dtype)
    if path in attention._AUTO_DECLINES:  # auto keeps SDPA for this bf16 path: run the kernel as `memra` does
        assert loaded.attention.value == "torch", loaded.attention.reason
        loaded = load_model("default", device="cpu", dtype=str(loaded.dtype).removeprefix("torch."),
                            prefill_attention="memra")
    assert loaded.attention.value == "memra", loaded.attention.reason
    assert loaded.model.config._attn_implementation == attention.NAME
    assert loaded.attention.reason.endswith(f": memra's prefill kernel, {attention._PATHS[path]}")
    engine = stories.make_engine(loaded, CHUNK, 2, max_sessions=4, max_bytes=2**31)
    first_turn = [{"role": "system", "content": "You are a coding agent. The repository:\n" + FILES},
                  {"role": "user", "content": "Which module defines helper_7?"}]
    first = stories.assert_second_turn_resumes_as_cold(engine, first_turn, "And which test covers it?")
    assert 1536 < first.prompt_tokens < 2048, first.prompt_tokens
