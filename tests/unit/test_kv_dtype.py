"""The KV cache's dtype (memrad.engine.model.kv_dtype): bf16 rows under fp32 activations where the
decode step reads them on memra's kernel, the activations' dtype elsewhere, and why.

With bf16 rows every token attends rounded rows, whoever wrote them: the slabs and window views
hold bf16, prefill attends the rows widened back, the one-row and batched steps write rounded rows
and read them as they are. So the promises hold as with fp32 rows: the compiled step has the
eager step's bits, a batched row its own bits, a resumed turn the cold run's tokens (test_reuse
and test_disk run their kinds under auto, which is bf16 rows for the tiny llama and Gemma 3).
What changes is the rows' precision: the logits stay within bf16's rounding of the fp32 cache's.
"""

import pytest
import torch

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.package import example_buffers, package_path
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import prefill
from memrad.engine.model import kv_dtype
from memrad.engine.model.loader import load_model
from memrad.engine.state.kv import resident_bytes
from stories import make_engine
from test_gemma_step import compiled_turns_equal_cold

WIDENED = "bf16 rows widened to fp32 by memra's decode kernel (half the bytes a long context's step reads)"
PROMPT = list(range(5, 45))


def load(tiny_dir, kind="llama", dtype="float32", kv="auto"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir(kind)), device="cpu", dtype=dtype, kv_dtype=kv)


def no_kernel_reason() -> str | None:
    return None


@pytest.mark.parametrize("mode,activations,device,step_why_not,expected", [
    ("auto", torch.float32, "cpu", None, ("bfloat16", f"auto: {WIDENED}")),
    ("bfloat16", torch.float32, "cpu", None, ("bfloat16", f"set by model.kv_dtype: {WIDENED}")),
    ("activations", torch.float32, "cpu", None, ("float32", "set by model.kv_dtype: the activations' dtype")),
    ("auto", torch.bfloat16, "cpu", None, ("bfloat16", "auto: the activations are bf16")),
    ("auto", torch.float16, "cpu", None, ("float16", "auto: the activations' dtype (the activations are float16)")),
    ("auto", torch.float32, "cuda", None,
     ("float32", "auto: the activations' dtype (the cache is on cuda, where transformers decodes)")),
    ("bfloat16", torch.float32, "cpu", "GptOssStep attends with torch, not memra's kernel",
     ("float32", "set by model.kv_dtype: the activations' dtype (GptOssStep attends with torch, not memra's kernel)")),
])
def test_the_rows_dtype_follows_the_activations_the_device_and_the_step(mode, activations, device, step_why_not,
                                                                        expected):
    choice = kv_dtype.decide(mode, activations, device, step_why_not, no_kernel_reason)
    assert (choice.value, choice.reason) == expected


def test_without_the_kernel_the_rows_keep_the_activations_dtype_and_say_why():
    choice = kv_dtype.decide("auto", torch.float32, "cpu", None, lambda: "memra's decode kernel: no C++ compiler")
    assert (choice.value, choice.reason) == ("float32", "auto: the activations' dtype (memra's decode kernel: no "
                                                        "C++ compiler)")
    with pytest.raises(ValueError, match="kv dtype must be one of auto, activations, bfloat16, got 'fp8'"):
        kv_dtype.decide("fp8", torch.float32, "cpu", None, no_kernel_reason)


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="memra's decode kernel is built with a C++ compiler")
def test_a_loaded_model_names_its_rows_dtype_and_its_caches_hold_it(tiny_dir):
    loaded = load(tiny_dir)
    assert (loaded.kv.value, loaded.kv.reason) == ("bfloat16", f"auto: {WIDENED}")
    assert kv_dtype.of(loaded.model) == torch.bfloat16 and loaded.model.dtype == torch.float32
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["kv"] == {"value": "bfloat16", "reason": f"auto: {WIDENED}"}
    cache, baseline = engine.new_cache(), load(tiny_dir, kv="activations")
    fp32_cache = Engine(baseline, EngineOptions(16, 1)).new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    prefill(baseline.model, fp32_cache, PROMPT, 0, 16)
    layer, fp32_layer = cache.layers[0], fp32_cache.layers[0]
    assert layer.slab.keys.dtype == layer.slab.values.dtype == torch.bfloat16
    assert torch.equal(layer.keys, fp32_layer.keys.to(torch.bfloat16))  # the same rows, rounded
    assert 2 * resident_bytes(layer)[1] == resident_bytes(fp32_layer)[1]
    with pytest.raises(ValueError, match="this model's KV dtype was set to 'auto'; load it again for 'activations'"):
        kv_dtype.choose(loaded.model, "activations")


def test_steps_that_attend_with_torch_keep_the_activations_dtype(tiny_dir):
    loaded = load(tiny_dir, "gpt_oss")
    assert loaded.kv.value == "float32"
    assert loaded.kv.reason == "auto: the activations' dtype (GptOssStep attends with torch, not memra's kernel)"
    assert load(tiny_dir, "llama", dtype="bfloat16").kv.value == "bfloat16"


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="memra's decode kernel is built with a C++ compiler")
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_bf16_rows_decode_within_bf16_rounding_of_fp32_rows(tiny_dir, kind):
    """The precision bf16 rows cost: the same greedy decode's logits, step after step."""
    ours, theirs = load(tiny_dir, kind), load(tiny_dir, kind, kv="activations")
    feeds = [Decoder(m.model, m.context_len, m.device).feeder() for m in (ours, theirs)]
    caches = [Engine(m, EngineOptions(16, 1)).new_cache() for m in (ours, theirs)]
    a, b = (prefill(m.model, c, PROMPT, 0, 16) for m, c in zip((ours, theirs), caches))
    worst = (a - b).abs().max()
    for step in range(24):
        token = int(b.argmax())
        a, b = (feed(cache, token, len(PROMPT) + step) for feed, cache in zip(feeds, caches))
        worst = max(worst, (a - b).abs().max())
    assert 0 < worst <= 2e-2, worst  # rounded rows (not fp32's bits), within bf16's rounding


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_step_over_bf16_rows_is_its_own_package_and_resumes_as_cold(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    loaded, baseline = load(tiny_dir), load(tiny_dir, kv="activations")
    eager = Decoder(loaded.model, loaded.context_len, loaded.device, "off")
    fp32_step = Decoder(baseline.model, baseline.context_len, baseline.device, "off").step
    names = [package_path(step, m.model.config, 64, True, tmp_path).name
             for step, m in ((eager.step, loaded), (fp32_step, baseline))]
    assert "-float32-kv-bfloat16-attn-memra-" in names[0] and "-kv-" not in names[1]
    keys, _, _ = example_buffers(eager.step, loaded.model.config, 64, 2, lambda *a: torch.empty(a[0], dtype=a[1]))
    assert {k.dtype for k in keys} == {torch.bfloat16}
    rows = compiled_turns_equal_cold(make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on"))
    assert all(row["warm"].prompt_tokens > 16 for row in rows)  # resumed past a chunk
