"""The decode step: what it computes, what it shares with the model, when it compiles.

A tiny llama decodes the same tokens through the step as through transformers' forward;
building the step leaves prefill's bits alone (it fuses projections by re-pointing the
model's weights into the fused tensors, not by copying them); the split attention of long
contexts equals plain attention; models the step does not cover keep transformers' forward,
with a reason; and a compiled engine (one AOTInductor graph, memra's attention kernel)
resumes turns that equal its cold turns bit for bit.
"""

import pytest
import torch
from torch.nn import functional as F

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode import steps
from memrad.engine.decode.steps import llama as decode_step
from memrad.engine.decode.steps.llama import SPLIT_ROWS, DecodeStep, attend
from memrad.engine.decode.decoder import CompileFailed, Decoder
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.loader import load_model
from memrad.engine.decode.package import PackagedStep
from test_reuse import conversation
from stories import make_engine

PROMPT = list(range(5, 45))  # 40 tokens of the tiny vocabulary


def fresh(tiny_llama_dir, dtype="float32"):
    torch.set_num_threads(1)
    return load_model(str(tiny_llama_dir), device="cpu", dtype=dtype)


def new_cache(loaded):
    return Engine(loaded, EngineOptions(16, 1)).new_cache()


def test_the_step_decodes_what_transformers_decodes(tiny_llama_dir):
    loaded = fresh(tiny_llama_dir)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = new_cache(loaded), new_cache(loaded)
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    for step in range(12):
        token = int(a.argmax())
        assert token == int(b.argmax()), f"step {step}"
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert ours.get_seq_length() == theirs.get_seq_length() == len(PROMPT) + 12
    assert torch.allclose(ours.layers[1].keys, theirs.layers[1].keys, atol=1e-5, rtol=0)


def test_building_the_step_shares_the_weights_and_leaves_prefill_bit_identical(tiny_llama_dir):
    loaded = fresh(tiny_llama_dir)
    before = prefill(loaded.model, new_cache(loaded), PROMPT, 0, 16)
    step = DecodeStep(loaded.model, loaded.context_len)
    attention = loaded.model.model.layers[0].self_attn
    fused = step.layers[0].qkv.weight  # [q + k + v rows, hidden]
    assert attention.k_proj.weight.data_ptr() == fused.data_ptr() + attention.q_proj.weight.numel() * fused.itemsize
    assert fused.shape[0] == attention.q_proj.out_features + 2 * attention.k_proj.out_features
    assert torch.equal(prefill(loaded.model, new_cache(loaded), PROMPT, 0, 16), before)


@pytest.mark.parametrize("rows", [SPLIT_ROWS - 1, SPLIT_ROWS, SPLIT_ROWS + 1, SPLIT_ROWS + 2])
def test_split_attention_equals_plain_attention(rows):
    torch.manual_seed(rows)
    q = torch.randn(1, 3, 3, 64)  # 9 query heads over 3 KV heads
    keys, values = torch.randn(1, 3, rows + 8, 64), torch.randn(1, 3, rows + 8, 64)  # a slab: rows + unused
    keys[:, :, rows:], values[:, :, rows:] = 1e4, -1e4  # stale rows past the end must not count
    expected = F.scaled_dot_product_attention(q.reshape(1, 9, 1, 64), keys[:, :, :rows], values[:, :, :rows],
                                              enable_gqa=True)
    got = attend(q, keys, values, rows, 64 ** -0.5)  # [1, 3, 3, 64]
    assert torch.allclose(got.reshape(1, 9, 1, 64), expected, atol=1e-5, rtol=0)


def test_models_the_step_does_not_cover_keep_transformers_forward_and_say_why(tiny_dir):
    dense = fresh(tiny_dir("starcoder2"))
    reason = steps.support(dense.model, dense.context_len)
    assert reason == ("Starcoder2ForCausalLM has no decode step (the steps cover LlamaForCausalLM, MistralForCausalLM, "
                      "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, "
                      "Gemma3ForCausalLM, Gemma4ForCausalLM, "
                      "Qwen3NextForCausalLM, FalconH1ForCausalLM, Lfm2ForCausalLM, GptOssForCausalLM)")
    chosen = Decoder(dense.model, dense.context_len, dense.device, "auto")
    assert (chosen.choice.value, chosen.choice.reason) == ("transformers", reason)
    assert Engine(dense, EngineOptions(16, 1)).runtime_choices["step"] == {"value": "none", "reason": reason}
    with pytest.raises(CompileFailed, match="compile = on, but Starcoder2ForCausalLM has no decode step"):
        Decoder(dense.model, dense.context_len, dense.device, "on")


def test_without_a_cxx_compiler_auto_stays_eager_and_on_refuses(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(decoder_module, "cxx_compiler", lambda: None)
    loaded = fresh(tiny_llama_dir)
    auto = Decoder(loaded.model, loaded.context_len, loaded.device, "auto")
    auto.start()
    auto.wait()
    assert auto.choice.value == "eager"
    assert auto.choice.reason == "auto: no C++ compiler for torch.compile (install g++, e.g. `apt install g++`)"
    with pytest.raises(CompileFailed, match="no C\\+\\+ compiler"):
        Decoder(loaded.model, loaded.context_len, loaded.device, "on").start()


@pytest.mark.parametrize("mode", ["auto", "wait"])
def test_under_auto_no_reply_waits_for_the_compile_and_under_wait_every_reply_does(tiny_llama_dir, monkeypatch,
                                                                                   mode):
    import inspect
    import threading

    loaded = fresh(tiny_llama_dir)
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device, mode)
    landed = threading.Event()
    compiled = object()  # what the build hands over: a step no eager call can be confused with

    def build_slowly():
        assert landed.wait(30)
        decoder._ready(compiled, False, "a test's build", 0.0)

    monkeypatch.setattr(decoder, "_open_package", lambda: False)  # an empty compile cache
    monkeypatch.setattr(decoder, "_compile", build_slowly)
    threading.Timer(0.3, landed.set).start()
    feed = decoder.feeder()  # the daemon has not started the compile yet: wait starts it here
    steps = [cell.cell_contents for cell in inspect.unwrap(feed.run).__closure__]  # what this reply decodes with
    if mode == "wait":
        assert compiled in steps and decoder.eager not in steps and decoder.choice.value == "compiled"
        assert feed.step == "compiled"
    else:  # auto answers at once with the eager step and says so; it never started the compile
        assert decoder.eager in steps and decoder.choice.value == "eager" and not decoder._started
        assert feed.step == "eager"
    landed.set()


def test_a_request_cancelled_while_it_waits_for_the_compile_stops_waiting(tiny_llama_dir, monkeypatch):
    import threading

    loaded = fresh(tiny_llama_dir)
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device, "wait")
    never = threading.Event()
    monkeypatch.setattr(decoder, "_open_package", lambda: False)
    monkeypatch.setattr(decoder, "_compile", lambda: never.wait(30))  # a build that outlasts the request
    hung_up = threading.Timer(0.2, lambda: None)
    hung_up.start()
    decoder.feeder(cancelled=lambda: not hung_up.is_alive())  # `memrad stop` must not wait for the build
    assert decoder.compiling() and decoder.choice.value == "compiling"
    assert decoder.choice.reason == "compile = wait: replies wait for the compiled step"
    never.set()


def test_the_slab_grows_when_a_step_writes_past_its_reservation(tiny_llama_dir):
    loaded = fresh(tiny_llama_dir)
    cache = new_cache(loaded)
    for layer in cache.layers:
        layer.capacity = len(PROMPT)  # reserve exactly the prompt: the first step must grow
    logits = prefill(loaded.model, cache, PROMPT, 0, 16)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    feed(cache, int(logits.argmax()), len(PROMPT))
    assert cache.layers[0].slab.capacity == 2 * len(PROMPT) and cache.get_seq_length() == len(PROMPT) + 1


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_a_compiled_engine_resumes_bit_identical_to_cold_without_recompiling(tiny_llama_dir):
    from torch._dynamo.utils import counters

    loaded = fresh(tiny_llama_dir, "bfloat16")
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="auto")
    before = counters["stats"]["unique_graphs"]
    engine.decoder.start()  # auto: in the background
    engine.decoder.wait()
    assert engine.decoder.choice.value == "compiled", engine.decoder.choice.reason
    assert "memra's attention kernel" in engine.decoder.choice.reason
    step = engine.decoder.step  # AOTInductor: dynamo traces nothing; torch.compile is the fallback
    assert isinstance(step, PackagedStep) and list(step.runners) == ["kernel"]  # one graph, every length
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == before
    for turn, row in enumerate(conversation(engine, 3)):
        if turn:
            assert row["warm"].decision.outcome == "resumed", row["warm"].decision.render()
        warm, cold = row["warm_state"].generated_ids, row["cold_state"].generated_ids
        assert warm == cold and len(warm) > 1
    assert counters["stats"]["unique_graphs"] == graphs, "a request waited for a compile"


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("weights,dtype,tolerance", [("float", "float32", 1e-6), ("int4", "bfloat16", 0.01)])
def test_the_compiled_step_computes_what_the_eager_step_computes(q4_dir, weights, dtype, tolerance):
    torch.set_num_threads(1)
    loaded = load_model(str(q4_dir), device="cpu", dtype=dtype, weights=weights)
    eager = Decoder(loaded.model, loaded.context_len, loaded.device, "off").feeder()
    compiled = Decoder(loaded.model, loaded.context_len, loaded.device, "on")
    compiled.start()
    assert compiled.choice.value == "compiled", compiled.choice.reason
    ours, theirs = new_cache(loaded), new_cache(loaded)
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    feed = compiled.feeder()
    for step in range(8):
        token = int(b.argmax())
        a, b = feed(ours, token, len(PROMPT) + step), eager(theirs, token, len(PROMPT) + step)
        assert torch.isfinite(a).all() and (a - b).abs().max() <= tolerance, (step, (a - b).abs().max())
