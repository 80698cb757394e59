"""Gemma 4 (text: Gemma4ForCausalLM) on its decode step, on the tiny random Gemma 4 of tests/unit/tiny.py
(per-layer inputs, the last two layers KV-shared, global layers of their own head dim with keys as
values and proportional rope, windows of 8, final soft-cap).

The step is named in `memrad status`; its cache keeps no rows for the KV-shared layers; in bf16 (float
weights, and Q4_1 layers on the int4 kernel) and fp32 its logits and KV rows are transformers' forward's bit for bit (the forward attending one
token with the step's layout, as tests/unit/test_experts.py says why) for 3W steps from a prompt
already past the window (fp32 held to 1e-6, what the fused matmuls may move); dropping a part the
forward has (the per-layer inputs, a KV-shared layer's producer) changes the bits; the batched
step gives a row the same bits at any neighbours and alone, and the one-row step's, step after
step past the window; an engine resumes turns bit-identically to their cold runs, eager and
compiled (one-row and batched packages, two rows on the compiled 2-row graph each the compiled
one-row step's bits past the window), and a rewritten reply at its windows' boundary snapshot. From a GGUF as llama.cpp lays it out (tests/unit/tiny_gguf.py:
write_gemma4_gguf), which transformers 5.24's loader cannot read (pinned), memra's reader
(memrad.engine.model.gguf_gemma4) loads the file's weights bit for bit and the tiny layout, on which
the step decodes the forward's bf16 bits and turns resume as cold, eager and on the compiled
packages; the banner lists every tensor kind's quant and `memrad status`'s tensors line every group's
kernel; a Q4_K_M-like file (width 256: Q4_K and Q6_K super-blocks) runs its blocks on the step as
the forward does; a tensor it does not place, or a layout key a config came out without, is named.

The mixture-of-experts Gemma 4 (tests/unit/tiny.py: build_gemma4(experts=8), 26B-A4B's layout: 8
experts of 64 beside every layer's MLP, top 2) runs the same tests: the forward's bits in bf16 and
fp32 to 1e-6, the router's ids and weights the forward's exactly, an expert no token chose never
read (NaN-poisoned), a token's bytes the router's and 2 of 8 experts', batched rows their own, turns
resumed as cold, compiled packages; and from a GGUF (ffn_gate_up_exps or ffn_gate_exps +
ffn_up_exps, ffn_down_exps, the router's scales) every weight is the file's and the banner and the
tensors line say the experts run dequantised and what a token reads of them.
"""

import pytest
import torch

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode import steps
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.package import PackagedStep
from memrad.engine.decode.steps import experts
from memrad.engine.decode.steps.gemma4 import Gemma4Step, producers
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.loader import load_model
from stories import make_engine
from test_batching import rows_are_their_own
from test_experts import routes, with_the_steps_attention_layout
from test_gemma_step import compiled_turns_equal_cold, rows_decode_their_own_bits
from test_gguf_steps import (compacted_reply_resumes_at_its_boundary, compiled_rows_are_the_one_row_steps,
                             turns_resume_as_cold)
from tiny import write_q4_folder

WINDOW = 8  # tests/unit/tiny.py: build_gemma4
PROMPT = list(range(5, 45))  # 40 tokens: past the window before the first step
LAYERS = ["WindowLayer", "WindowLayer", "SlabLayer", "WindowLayer", "SharedLayer", "SharedLayer"]


KINDS = ["gemma4", "gemma4_moe"]  # tests/unit/tiny.py: dense, and with 8 experts beside every MLP (top 2)


def fresh(tiny_dir, dtype="bfloat16", kind="gemma4"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir(kind)), device="cpu", dtype=dtype)


@pytest.fixture(scope="module")
def q4_gemma4_dir(tmp_path_factory):
    """The tiny Gemma 4 as a GGUF's blocks: Q4_1 layers, a tied Q8_0 head (tiny.write_q4_folder)."""
    return write_q4_folder(tmp_path_factory.mktemp("tiny-gemma4-q4"), "gemma4")


def on_int4(folder):
    torch.set_num_threads(1)
    loaded = load_model(str(folder), device="cpu", dtype="bfloat16", weights="int4")
    assert loaded.weights.value == "int4"
    return loaded


def test_the_gemma4_step_covers_it_and_says_so(tiny_dir):
    loaded = fresh(tiny_dir)
    reason = ("Gemma4ForCausalLM layers on one graph: 4 sliding-window, 2 full-attention; "
              "the last 2 attend earlier layers' KV")
    assert steps.describe(loaded.model, loaded.context_len) == steps.Choice("gemma4", reason)
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["step"] == {"value": "gemma4", "reason": reason}
    step = engine.decoder.eager_step
    assert isinstance(step, Gemma4Step) and steps.has_batched(step)
    assert producers(loaded.model.config) == [0, 1, 2, 3, 3, 2]
    assert [(layer.kv_heads, layer.head_dim, layer.window) for layer in step.layers] == [
        (2, 16, 8), (2, 16, 8), (1, 32, None), (2, 16, 8), (2, 16, 8), (1, 32, None)]
    assert steps.windows(step) == [8, 8, None, 8, None, None] and steps.slabs(step) == [2]
    assert [type(layer).__name__ for layer in engine.new_cache().layers] == LAYERS


def test_the_moe_gemma4_step_covers_it_and_says_so(tiny_dir):
    loaded = fresh(tiny_dir, kind="gemma4_moe")
    reason = ("Gemma4ForCausalLM layers on one graph: 4 sliding-window, 2 full-attention; experts: top 2 of 8 "
              "per token; the last 2 attend earlier layers' KV")
    assert steps.describe(loaded.model, loaded.context_len) == steps.Choice("gemma4-moe", reason)
    step = Engine(loaded, EngineOptions(16, 1)).decoder.eager_step
    assert isinstance(step, Gemma4Step) and all(layer.moe for layer in step.layers)


def test_a_moe_gemma4_token_reads_its_router_and_two_of_eight_experts(tiny_dir):
    """Per layer: the router (proj [8, 64], scale [64], per-expert scales [8]) and 2 of 8 experts
    (gate_up [128, 64], down [64, 64]) besides the dense MLP (gate, up [128, 64], down [64, 128])."""
    model = fresh(tiny_dir, kind="gemma4_moe").model
    mlp, router, expert = 3 * 128 * 64 * 2, (8 * 64 + 64 + 8) * 2, (128 * 64 + 64 * 64) * 2
    assert experts.bytes_per_token(model) == (6 * (mlp + router + 2 * expert), 6 * (mlp + router + 8 * expert))


def test_bidirectional_and_all_shared_gemma4_have_no_step(tiny_dir):
    loaded = fresh(tiny_dir)
    loaded.model.config.use_bidirectional_attention = "all"
    assert steps.support(loaded.model, loaded.context_len) == "Gemma4ForCausalLM attends bidirectionally"
    loaded.model.config.use_bidirectional_attention, loaded.model.config.num_kv_shared_layers = None, 6
    assert steps.support(loaded.model, loaded.context_len) == (
        "Gemma4ForCausalLM reads every layer's keys and values from another model (num_kv_shared_layers = all)")


@pytest.mark.parametrize("dtype,tolerance,kind", [("bfloat16", 0.0, "gemma4"), ("float32", 1e-6, "gemma4"),
                                                  ("int4", 0.0, "gemma4"), ("bfloat16", 0.0, "gemma4_moe"),
                                                  ("float32", 1e-6, "gemma4_moe")])
def test_the_gemma4_step_decodes_transformers_bits_past_the_window(tiny_dir, q4_gemma4_dir, dtype, tolerance, kind):
    """bf16 and fp32 with float weights, dense and MoE; "int4": bf16 on the int4 kernel (Q4_1 layers,
    the step's fused projections against the forward's one by one)."""
    loaded = on_int4(q4_gemma4_dir) if dtype == "int4" else fresh(tiny_dir, dtype, kind)
    decodes_the_forwards_bits(loaded, tolerance)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_moe_router_chooses_what_the_forward_chooses_and_no_other_expert_is_read(tiny_dir, dtype):
    """Step after step the step's router call returns the forward's ids and weights exactly; then
    with every expert a token did not choose poisoned with NaN its logits do not change, and with a
    chosen one poisoned they are NaN (the test can fail)."""
    loaded = fresh(tiny_dir, dtype, "gemma4_moe")
    engine = Engine(loaded, EngineOptions(16, 1))
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = engine.new_cache(), engine.new_cache()
    prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    with_the_steps_attention_layout(loaded.model, feed.kernel)
    seen = routes(loaded.model, lambda layer: layer.router)  # Gemma 4's sits on the layer
    for step in range(WINDOW):
        token = int(b.argmax())
        seen.clear()
        a = feed(ours, token, len(PROMPT) + step)
        mine = seen[:]
        seen.clear()
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert len(mine) == len(seen) == 6
        for (layer, ids, weights), (layer_f, ids_f, weights_f) in zip(mine, seen):
            assert layer == layer_f and ids.shape == (1, 2)
            assert torch.equal(ids, ids_f) and torch.equal(weights, weights_f)
    clean, poisoned, poisoned_chosen = (engine.new_cache() for _ in range(3))
    for cache in (clean, poisoned, poisoned_chosen):
        prefill(loaded.model, cache, PROMPT, 0, 16)  # the prompt read every expert
    seen.clear()
    expected = feed(clean, 7, len(PROMPT))
    chosen = {layer: set(ids.view(-1).tolist()) for layer, ids, _ in seen}
    layers = loaded.model.model.layers
    with torch.no_grad():
        for index, layer in enumerate(layers):
            for e in set(range(8)) - chosen[index]:
                layer.experts.gate_up_proj[e] = float("nan")
                layer.experts.down_proj[e] = float("nan")
    assert torch.equal(feed(poisoned, 7, len(PROMPT)), expected)
    with torch.no_grad():
        layers[1].experts.down_proj[min(chosen[1])] = float("nan")
    assert torch.isnan(feed(poisoned_chosen, 7, len(PROMPT))).all()


def decodes_the_forwards_bits(loaded, tolerance):
    """The step's logits and kept KV rows are the forward's (within `tolerance`) for 3W steps from a
    prompt already past the window."""
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    assert feed.step == "eager"
    engine = Engine(loaded, EngineOptions(16, 1))
    ours, theirs = engine.new_cache(), engine.new_cache()
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    assert torch.equal(a, b)
    with_the_steps_attention_layout(loaded.model, feed.kernel)
    for step in range(3 * WINDOW):  # the window's buffer (2W rows) moves
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert float((a - b).abs().max()) <= tolerance, (step, float((a - b).abs().max()))
    assert ours.get_seq_length() == theirs.get_seq_length() == len(PROMPT) + 3 * WINDOW
    for mine, forward in zip(ours.layers[:4], theirs.layers[:4]):  # the layers that keep rows
        assert float((mine.keys - forward.keys).abs().max()) <= tolerance
        assert float((mine.values - forward.values).abs().max()) <= tolerance
    assert ours.layers[0].keys.shape[-2] == WINDOW - 1 and ours.layers[2].keys.shape[-2] == len(PROMPT) + 3 * WINDOW


def test_the_step_needs_every_part_it_has(tiny_dir):
    """The tiny config exercises what the step computes: without the per-layer inputs, or with a
    KV-shared layer attending its own kind's other layer, the bits differ from the forward's."""
    loaded = fresh(tiny_dir, "float32")
    engine = Engine(loaded, EngineOptions(16, 1))
    cache = engine.new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    expected = decode_one_token(loaded.model, cache, 7, len(PROMPT))

    def logits(change):
        step = Gemma4Step(loaded.model, loaded.context_len)
        change(step)
        cache = engine.new_cache()
        prefill(loaded.model, cache, PROMPT, 0, 16)
        buffers = [layer.step_buffers(len(PROMPT)) for layer in cache.layers]
        with torch.inference_mode():  # the slabs are inference tensors
                return step.forward_rows(torch.tensor([7]), torch.tensor([len(PROMPT)]), [len(PROMPT) + 1],
                                     [[k for k, _ in buffers]], [[v for _, v in buffers]], False)[0]

    # fp32 sums in other orders than the forward's: 1e-6 apart on AVX512, 1.15e-6 on an AVX2-only Zen 2
    assert float((logits(lambda step: None) - expected).abs().max()) <= 4e-6
    def without_per_layer_inputs(step):
        for layer in step.layers:
            layer.per_layer = False

    assert not torch.allclose(logits(without_per_layer_inputs), expected, atol=1e-4)
    assert not torch.allclose(logits(lambda step: setattr(step, "producers", [0, 1, 2, 3, 1, 2])), expected, atol=1e-4)


@pytest.mark.parametrize("dtype,kind", [("bfloat16", "gemma4"), ("float32", "gemma4"), ("int4", "gemma4"),
                                        ("bfloat16", "gemma4_moe"), ("float32", "gemma4_moe")])
def test_every_row_of_the_batched_gemma4_step_is_its_own_and_the_one_row_steps(tiny_dir, q4_gemma4_dir, dtype, kind):
    """MoE: each row routed on its own (memrad.engine.decode.steps.experts.feed_forward)."""
    loaded = on_int4(q4_gemma4_dir) if dtype == "int4" else fresh(tiny_dir, dtype, kind)
    engine = make_engine(loaded, 16, max_batch=4)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    first = rows_are_their_own(engine, loaded.model, 16)
    if dtype != "float32":  # fp32 matmuls take another path at M = 1 (memrad.engine.decode.batch)
        cache = engine.new_cache()
        prefill(loaded.model, cache, list(range(5, 45)), 0, 16)
        assert torch.equal(engine.decoder.feeder()(cache, 11, 40).float(), first)
        rows_decode_their_own_bits(engine, loaded.model, WINDOW)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gemma4_engine_resumes_turns_bit_identical_to_cold(tiny_dir, kind):
    turns_resume_as_cold(make_engine(fresh(tiny_dir, kind=kind), 16, max_sessions=16, mode="exact"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_rewritten_gemma4_reply_resumes_from_the_windows_boundary_snapshot_below_it(tiny_dir, kind):
    """The sliding windows cannot be cut back (their older rows are gone) and the KV-shared layers
    keep none of their own: a client that compacts turn 2's reply resumes at the snapshot taken at
    that reply's anchor, far past the window, and its turn is the cold run's bit for bit."""
    engine = make_engine(fresh(tiny_dir, kind=kind), 16, max_sessions=16, mode="exact")
    assert compacted_reply_resumes_at_its_boundary(engine)[1] > 4 * WINDOW


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("kind", KINDS)
def test_the_compiled_gemma4_step_computes_what_the_eager_step_computes_and_resumes_as_cold(tiny_dir, kind):
    """compile = on, max_batch 2: the one-row package (memra's kernel over the window views,
    nothing handed for the KV-shared layers) decodes the eager step's logits within 1e-5 (fp32:
    inductor fuses) from windows shorter than W to past it; in bf16 the batched package gives a
    row the compiled one-row step's bits, and turns resume as cold; two rows side by side on the
    compiled 2-row graph (one past the window, one filling it) are each the compiled one-row step's
    bits, step after step."""
    loaded = fresh(tiny_dir, "float32", kind)
    eager = Decoder(loaded.model, loaded.context_len, loaded.device, "off").feeder()
    compiled = Decoder(loaded.model, loaded.context_len, loaded.device, "on")
    compiled.start()
    assert compiled.choice.value == "compiled", compiled.choice.reason
    assert isinstance(compiled.step, PackagedStep) and list(compiled.step.runners) == ["kernel"]
    feed = compiled.feeder()
    engine = Engine(loaded, EngineOptions(16, 1))
    ours, theirs = engine.new_cache(), engine.new_cache()
    prefill(loaded.model, ours, PROMPT[:2], 0, 16)
    b = prefill(loaded.model, theirs, PROMPT[:2], 0, 16)
    for step in range(4 * WINDOW):
        token = int(b.argmax())
        a, b = feed(ours, token, 2 + step), eager(theirs, token, 2 + step)
        assert float((a - b).abs().max()) <= 1e-5, (step, float((a - b).abs().max()))
    engine = make_engine(fresh(tiny_dir, kind=kind), 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
    engine.decoder.start()
    assert engine.decoder.batch_choice.value == "compiled", engine.decoder.batch_choice.reason
    batched = engine.decoder.batch_step(2)
    assert batched.compiled and batched.alone is not None  # the compiled one-row step's bits, checked
    compiled_turns_equal_cold(engine)
    compiled_rows_are_the_one_row_steps(engine, (PROMPT, PROMPT[:5]), 2 * WINDOW)  # the short one fills its window


# -- from a GGUF: transformers 5.24's loader does not read a gemma4 header's layout; memra's reader does --

@pytest.fixture(scope="module")
def gemma4_gguf(tmp_path_factory):
    """(the tiny Gemma 4's GGUF as llama.cpp lays it out, the model holding what it dequantises to)."""
    from tiny import build_gemma4, build_tokenizer
    from tiny_gguf import write_gemma4_gguf

    tokenizer = build_tokenizer()
    model = build_gemma4(len(tokenizer))
    return write_gemma4_gguf(tmp_path_factory.mktemp("tiny-gemma4-gguf") / "tiny-gemma4.gguf", model, tokenizer), model


def from_gguf(path, dtype="bfloat16"):
    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype=dtype, progress=lambda _: None)


def test_transformers_gguf_loader_reads_gemma4_without_its_layout(gemma4_gguf):
    """Why memra reads a Gemma 4 GGUF itself (memrad.engine.model.gguf_gemma4): transformers' config
    mapping (transformers.integrations.ggml, "gemma4") reads the widths and head counts but none of
    llama.cpp's layout keys, so its config would keep Gemma4TextConfig's defaults (a 5:1 layer
    pattern, no KV-shared layers, per-layer inputs of 256, sliding head dim 256, rope bases 10k / 1M,
    no final soft-cap); and it takes llama.cpp's KV heads per layer for one count, so it builds no
    config at all. When this starts failing, transformers reads them."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig, Gemma4TextConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    path, _ = gemma4_gguf
    mapping = GGUF_CONFIG_MAPPING["gemma4"]
    for key in ("attention.sliding_window_pattern", "attention.shared_kv_layers", "embedding_length_per_layer_input",
                "attention.key_length_swa", "attention.value_length_swa", "rope.freq_base_swa",
                "final_logit_softcapping"):
        assert key not in mapping
    assert mapping["rope.freq_base"] is None and mapping["attention.head_count_kv"] == "num_key_value_heads"
    defaults = Gemma4TextConfig()
    assert defaults.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (defaults.num_kv_shared_layers, defaults.hidden_size_per_layer_input, defaults.per_layer_config[0].head_dim,
            defaults.final_logit_softcapping) == (0, 256, 256, None)
    with pytest.raises(StrictDataclassFieldValidationError, match="num_key_value_heads"):
        AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def test_a_gemma4_gguf_loads_on_memras_reader_as_the_tiny_model(gemma4_gguf):
    """Every parameter and layer scalar is what the file's tensors dequantise to, the config is the
    tiny model's layout (read from llama.cpp's keys and rope_freqs), the model is on the Gemma 4
    step, and `memrad start`'s banner says so before the wait."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from memrad.engine.model.preflight import inspect_gguf

    path, model = gemma4_gguf
    loaded = from_gguf(path, "float32")
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    shipped = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    q = shipped["blk.2.attn_q.weight"]
    assert q.tensor_type.name == "Q8_0" and torch.equal(loaded.model.model.layers[2].self_attn.q_proj.weight,
                                                        torch.from_numpy(dequantize(q.data, q.tensor_type).copy()))
    assert float(loaded.model.model.layers[3].layer_scalar) == float(shipped["blk.3.layer_output_scale.weight"].data[0])
    config, tiny = loaded.model.config, model.config
    for field in ("layer_types", "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                  "attention_k_eq_v", "sliding_window", "final_logit_softcapping", "rope_parameters",
                  "num_attention_heads", "intermediate_size", "hidden_size", "vocab_size",
                  "use_double_wide_mlp", "tie_word_embeddings", "enable_moe_block"):
        assert getattr(config, field) == getattr(tiny, field), field
    assert [(config.per_layer_config[i].head_dim, config.per_layer_config[i].num_key_value_heads)
            for i in range(6)] == [(tiny.per_layer_config[i].head_dim, tiny.per_layer_config[i].num_key_value_heads)
                                   for i in range(6)] == [(16, 2), (16, 2), (32, 1), (16, 2), (16, 2), (32, 1)]
    reason = ("Gemma4ForCausalLM layers on one graph: 4 sliding-window, 2 full-attention; "
              "the last 2 attend earlier layers' KV")
    assert Engine(loaded, EngineOptions(16, 1)).runtime_choices["step"] == {"value": "gemma4", "reason": reason}
    lines = inspect_gguf(path, 0, torch.bfloat16).lines()
    assert lines[0] == "tiny-gemma4.gguf: gemma4 (Gemma4ForCausalLM)"
    assert lines[1] == f"  fast decode step: yes, memra's gemma4 step ({reason})"


@pytest.mark.parametrize("gguf", ["gemma4_gguf", "gemma4_moe_gguf"])
def test_the_gemma4_step_from_the_gguf_decodes_transformers_bits_and_resumes_as_cold(request, gguf):
    """bf16, dense and MoE: the step's logits are the forward's bit for bit for 3W steps past the
    window, on the GGUF's weights; an engine resumes turns bit-identically to their cold runs."""
    path, _ = request.getfixturevalue(gguf)
    loaded = from_gguf(path)
    assert isinstance(Engine(loaded, EngineOptions(16, 1)).decoder.eager_step, Gemma4Step)
    decodes_the_forwards_bits(loaded, 0.0)
    turns_resume_as_cold(make_engine(from_gguf(path), 16, max_sessions=16, mode="exact"))


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("gguf", ["gemma4_gguf", "gemma4_moe_gguf"])
def test_the_compiled_gemma4_packages_from_the_gguf_resume_as_cold_and_batch_as_alone(request, gguf):
    """compile = on, max_batch 2, from the GGUF on `auto` (its Q8_0 layers as int4 or blocks, the
    head on memra's block kernel, dense and MoE): the one-row and 2-row packages are built (minutes
    on a shared 2-core machine) and open, turns resume on them bit-identical to their cold runs, and
    two rows on the compiled 2-row graph are each the compiled one-row step's bits, step after step
    past the window."""
    path, _ = request.getfixturevalue(gguf)
    loaded = from_gguf(path)
    assert loaded.weights.value == "int4"
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
    compiled_turns_equal_cold(engine)
    compiled_rows_are_the_one_row_steps(engine, (PROMPT, PROMPT[:5]), 2 * WINDOW)


def tensor_groups(reason: str) -> dict[str, str]:
    """{module group: "KIND xCOUNT"} of a tensors reason ("group KIND xN: kernel (why); ...")."""
    groups = {}
    for part in reason.split("; "):
        if ": " in part and " x" in part.split(": ")[0]:
            name, kind, count = part.split(": ")[0].rsplit(" ", 2)
            groups[name] = f"{kind} {count}"
    return groups


@pytest.mark.parametrize("gguf", ["gemma4_gguf", "gemma4_moe_gguf"])
def test_a_gemma4_gguf_names_its_quants_before_it_loads_and_its_kernels_in_status(request, gguf):
    """`memrad start`'s banner lists the quant of every tensor kind the file holds (the per-layer
    inputs' inp_gate / proj / post_norm and per_layer_* tensors, the layer scalar, rope_freqs, the
    experts and the router's scales), the KV a token keeps (the 4 layers with rows of their own: the
    KV-shared pair keeps none) and the windows; `memrad status`'s tensors line counts every
    projection the file quantised by group (the KV-shared layers have no k / v; the full layers' keys
    are their values: no v), says the 8-row per-layer gate stays dense because the int4 kernel packs
    rows in sixteens, the F32 per-layer projection dense as shipped, and the experts dequantised."""
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model import kernel_choice
    from memrad.engine.model.preflight import inspect_gguf

    path, _ = request.getfixturevalue(gguf)
    moe = gguf == "gemma4_moe_gguf"
    lines = inspect_gguf(path, 0, torch.bfloat16).lines()
    experts = ("ffn_gate_inp Q8_0; ffn_gate_up_exps Q8_0; ffn_down_exps Q8_0; post_ffw_norm_1 F32; "
               "post_ffw_norm_2 F32; pre_ffw_norm_2 F32; " if moe else "")
    scales = "; ffn_gate_inp.scale F32; ffn_down_exps.scale F32" if moe else ""
    assert lines[2] == (
        "  quants: rope_freqs F32; token_embd Q8_0; layer_output_scale F32; attn_q Q8_0; attn_q_norm F32; "
        "attn_k_norm F32; attn_k Q8_0; attn_v Q8_0; attn_output Q8_0; ffn_gate Q8_0; ffn_up Q8_0; ffn_down Q8_0; "
        "attn_norm F32; post_attention_norm F32; ffn_norm F32; post_ffw_norm F32; inp_gate Q8_0; proj F32; "
        f"post_norm F32; {experts}output_norm F32; per_layer_token_embd F32; per_layer_model_proj Q8_0; "
        f"per_layer_proj_norm F32{scales}")
    # 2 sliding layers x K and V x 2 KV heads x 16 dims + 2 full layers x K (its values) x 1 x 32, bf16
    assert lines[3:5] == ["  context: native 1,024, served 1,024 (native)",
                          "  KV: 512 B/token in bfloat16; 4 sliding-window layers keep at most 8 rows"]
    tensors = Engine(from_gguf(path), EngineOptions(16, 1)).runtime_choices["tensors"]
    quantised = {"lm_head": "Q8_0 x1", "mlp.down_proj": "Q8_0 x6", "mlp.gate_proj": "Q8_0 x6",
                 "mlp.up_proj": "Q8_0 x6", "per_layer_input_gate": "Q8_0 x6", "per_layer_projection": "F32 x6",
                 "self_attn.k_proj": "Q8_0 x4", "self_attn.o_proj": "Q8_0 x6", "self_attn.q_proj": "Q8_0 x6",
                 "self_attn.v_proj": "Q8_0 x3", "model.per_layer_model_projection": "Q8_0 x1"}
    if moe:
        quantised |= {"experts.down_proj": "Q8_0 x6", "experts.gate_up_proj": "Q8_0 x6", "router.proj": "Q8_0 x6"}
    assert tensor_groups(tensors["reason"]) == quantised
    # AVX512: the Q8_0 layers' offline verdict (torch's int4), which cannot take 8 rows: dense; AVX2
    # (verdicts measured at load): such layers run memra's block kernel unmeasured
    measured = block_gemv.capability() in kernel_choice.MEASURED_ON
    gate = (f"Q8_0 blocks (memra block kernel, {block_gemv.path()} (the int4 kernel packs rows in sixteens))"
            if measured else "dense bfloat16 (the int4 kernel packs rows in sixteens and it has 8)")
    assert f"per_layer_input_gate Q8_0 x6: {gate}" in tensors["reason"]
    assert "per_layer_projection F32 x6: dense bfloat16 (shipped unquantized)" in tensors["reason"]
    # AVX512: the head's rows 16 side by side; AVX2: as measured, with the Q8_0 layers it may share a row with
    heads = ("Q8_0 x16 blocks ", "Q8_0 blocks ") if measured else (
        "Q8_0 x16 blocks 1" if block_gemv.interleaves() else "Q8_0 blocks 1",)
    assert tensors["value"].startswith(heads)
    # the gates (AVX512), the F32 projections; the experts, the 8-row routers (AVX512)
    dense = (6 + (0 if measured else 6)) + ((6 + 6) + (0 if measured else 6) if moe else 0)
    assert f"dense bfloat16 {dense}" in tensors["value"].split(", ")
    if moe:  # 2 of 8 experts, 6 layers: down [64, 64], bf16; 34 bytes a 32 in Q8_0
        assert (f"experts.down_proj Q8_0 x6: dense bfloat16 (3-D expert tensors, dequantised: no packed form; a "
                f"token reads {6 * 2 * 64 * 64 * 2:,} B of them ({6 * 2 * 64 * 2 * 34:,} B as shipped))"
                ) in tensors["reason"]


@pytest.fixture(scope="module")
def gemma4_kquant_gguf(tmp_path_factory):
    """(the tiny Gemma 4 at width 256 as a Q4_K_M file mixes its quants, the model holding what it
    dequantises to): q, k, v, gate, up and the per-layer input gate Q4_K, ffn_down Q6_K,
    attn_output (rows of 64), the embedding and the per-layer model projection Q8_0 (tiny_gguf.write_gemma4_gguf(kquants=True))."""
    from tiny import build_gemma4, build_tokenizer
    from tiny_gguf import write_gemma4_gguf

    tokenizer = build_tokenizer()
    model = build_gemma4(len(tokenizer), width=256)
    folder = tmp_path_factory.mktemp("tiny-gemma4-q4_k")
    return write_gemma4_gguf(folder / "tiny-gemma4-q4_k.gguf", model, tokenizer, kquants=True), model


def test_a_k_quant_gemma4_gguf_runs_its_super_blocks_on_the_step_as_the_forward(gemma4_kquant_gguf):
    """Gemma 4 GGUFs ship as Q4_K_M: the file's Q4_K and Q6_K tensors load as what they dequantise to
    (float weights, every parameter the file's), the banner names them, on `auto` they run from their
    super-blocks or torch's int4 as measured (the tensors line: the per-layer input gate's 8 rows,
    which the int4 kernel cannot pack, on memra's kernel without keeping the other Q4_K layers off
    the measurement), and the step decodes the forward's bf16 bits on them for 3W steps
    past the window, float weights and blocks, and resumes turns as cold."""
    from memrad.engine.model.preflight import inspect_gguf

    path, model = gemma4_kquant_gguf
    quants = dict(part.rsplit(" ", 1) for part in inspect_gguf(path, 0, torch.bfloat16).lines()[2]
                  .removeprefix("  quants: ").split("; "))
    assert {kind: quants[kind] for kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down",
                                            "attn_output", "inp_gate", "per_layer_model_proj", "token_embd")} == {
        "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
        "ffn_down": "Q6_K", "attn_output": "Q8_0", "inp_gate": "Q4_K", "per_layer_model_proj": "Q8_0",
        "token_embd": "Q8_0"}
    loaded = load_model(str(path), device="cpu", dtype="float32", weights="float", progress=lambda _: None)
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    blocks = from_gguf(path)
    assert blocks.weights.value == "int4"
    groups = tensor_groups(blocks.tensors.reason)
    assert {name: groups[name] for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")} == {
        "self_attn.q_proj": "Q4_K x6", "self_attn.k_proj": "Q4_K x4", "self_attn.v_proj": "Q4_K x3",
        "mlp.gate_proj": "Q4_K x6", "mlp.up_proj": "Q4_K x6", "mlp.down_proj": "Q6_K x6",
        "self_attn.o_proj": "Q8_0 x6"}
    why = dict(part.split(": ", 1) for part in blocks.tensors.reason.split("; ") if " x" in part.split(": ")[0])
    assert not why["self_attn.q_proj Q4_K x6"].startswith("dense")  # run from the blocks, not dequantised
    # the 8-row gate cannot go on torch's int4 packer; the Q4_K layers in sixteens are measured all the same
    assert why["per_layer_input_gate Q4_K x6"].endswith("(the int4 kernel packs rows in sixteens))")
    assert why["mlp.gate_proj Q4_K x6"].endswith("(measured at load, one row))"), why["mlp.gate_proj Q4_K x6"]
    for weights in (blocks, load_model(str(path), device="cpu", dtype="bfloat16", weights="float",
                                       progress=lambda _: None)):
        assert isinstance(Engine(weights, EngineOptions(16, 1)).decoder.eager_step, Gemma4Step)
        decodes_the_forwards_bits(weights, 0.0)
    turns_resume_as_cold(make_engine(from_gguf(path), 16, max_sessions=16, mode="exact"))


def test_a_gemma4_gguf_memras_reader_cannot_place_is_refused_by_name(gemma4_gguf, tmp_path):
    """A tensor memra's table does not name (a shared expert's router, which Gemma 4 has not) is
    refused before the wait and at the load, by name; a router in a file without expert_count (a
    dense config) is refused at the load, by where it would go."""
    from tiny import build_gemma4, build_tokenizer
    from tiny_gguf import write_gemma4_gguf

    from memrad.engine.model.preflight import inspect_gguf
    from memrad.engine.model.pull import ModelUnavailable

    tokenizer = build_tokenizer()
    experts = write_gemma4_gguf(tmp_path / "experts.gguf", build_gemma4(len(tokenizer)), tokenizer,
                                extra=[("blk.0.ffn_gate_inp_shexp.weight", [[0.0] * 64] * 4)])
    with pytest.raises(ModelUnavailable, match="tensors memra's reader does not place: blk.0.ffn_gate_inp_shexp.weight"):
        inspect_gguf(experts, 0, torch.bfloat16)
    with pytest.raises(ModelUnavailable, match="blk.0.ffn_gate_inp_shexp.weight"):
        from_gguf(experts)
    router = write_gemma4_gguf(tmp_path / "router.gguf", build_gemma4(len(tokenizer)), tokenizer,
                               extra=[("blk.0.ffn_gate_inp.weight", [[0.0] * 64] * 4)])
    with pytest.raises(ModelUnavailable, match="blk.0.ffn_gate_inp.weight goes to model.layers.0.router.proj.weight, "
                                               "which its config does not have"):
        from_gguf(router)  # a router without expert_count: a dense config


def test_a_config_without_the_files_layout_is_named_key_by_key(gemma4_gguf):
    """What preflight refuses a gemma4 GGUF on where a config came out other than the file says:
    none for the tiny model's own config, every layout key for the defaults transformers' loader
    would keep (it reads none of them)."""
    from transformers import Gemma4TextConfig

    from memrad.engine.model.gguf_header import read_header
    from memrad.engine.model.preflight import gemma4_layout_lost

    path, model = gemma4_gguf
    header = read_header(path)
    assert gemma4_layout_lost(header, model.config) == []
    lost = gemma4_layout_lost(header, Gemma4TextConfig(vocab_size=len(model.model.embed_tokens.weight)))
    assert [line.split(":")[0] for line in lost] == [
        "attention.sliding_window_pattern", "attention.shared_kv_layers", "embedding_length_per_layer_input",
        "attention.key_length_swa", "rope.freq_base", "rope.freq_base_swa", "final_logit_softcapping",
        "per_layer_token_embd rows"]
    assert "attention.shared_kv_layers: the GGUF's 2, the config's 0" in lost


# -- a mixture-of-experts Gemma 4 from a GGUF (26B-A4B's layout): memra's reader places its router and experts --

MOE_REASON = ("Gemma4ForCausalLM layers on one graph: 4 sliding-window, 2 full-attention; experts: top 2 of 8 per "
              "token; the last 2 attend earlier layers' KV")


def write_moe(folder, split=False, drop=()):
    """(the tiny MoE Gemma 4's GGUF, the model holding what it dequantises to)."""
    from tiny import GEMMA4_EXPERTS, build_gemma4, build_tokenizer
    from tiny_gguf import write_gemma4_gguf

    tokenizer = build_tokenizer()
    model = build_gemma4(len(tokenizer), experts=GEMMA4_EXPERTS)
    path = write_gemma4_gguf(folder / "tiny-gemma4-moe.gguf", model, tokenizer, split_experts=split, drop=drop)
    return path, model


@pytest.fixture(scope="module")
def gemma4_moe_gguf(tmp_path_factory):
    return write_moe(tmp_path_factory.mktemp("tiny-gemma4-moe-gguf"))


@pytest.mark.parametrize("split", [False, True])
def test_a_moe_gemma4_gguf_loads_its_router_and_experts_as_the_file_holds_them(tmp_path, split):
    """Every parameter is what the file's tensors dequantise to: the experts' gate_up as shipped
    whole (ffn_gate_up_exps) or as gate and up apart (its first and second I rows), the router's
    scale and per-expert scales (ffn_gate_inp.scale, ffn_down_exps.scale), the three extra norms;
    the config is a mixture of 8 experts, 2 a token; the banner names the step with its experts and
    what a token reads of them, and the engine's tensors line says they run dequantised."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from memrad.engine.model.preflight import inspect_gguf

    path, model = write_moe(tmp_path, split)
    loaded = from_gguf(path, "float32")
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    shipped = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    as_float = lambda name: torch.from_numpy(dequantize(shipped[name].data, shipped[name].tensor_type).copy())  # noqa: E731
    layer = loaded.model.model.layers[1]
    if split:
        assert "blk.1.ffn_gate_up_exps.weight" not in shipped and shipped["blk.1.ffn_up_exps.weight"].tensor_type.name == "Q8_0"
        assert torch.equal(layer.experts.gate_up_proj, torch.cat([as_float("blk.1.ffn_gate_exps.weight"),
                                                                  as_float("blk.1.ffn_up_exps.weight")], dim=1))
    else:
        assert shipped["blk.1.ffn_gate_up_exps.weight"].tensor_type.name == "Q8_0"
        assert torch.equal(layer.experts.gate_up_proj, as_float("blk.1.ffn_gate_up_exps.weight"))
    assert torch.equal(layer.experts.down_proj, as_float("blk.1.ffn_down_exps.weight"))
    assert torch.equal(layer.router.scale, as_float("blk.1.ffn_gate_inp.scale"))
    assert torch.equal(layer.router.per_expert_scale, as_float("blk.1.ffn_down_exps.scale"))
    assert torch.equal(layer.pre_feedforward_layernorm_2.weight, as_float("blk.1.pre_ffw_norm_2.weight"))
    config = loaded.model.config
    assert (config.enable_moe_block, config.num_experts, config.top_k_experts, config.moe_intermediate_size) == (
        True, 8, 2, 64)
    lines = inspect_gguf(path, 0, torch.bfloat16).lines()
    assert lines[0] == "tiny-gemma4-moe.gguf: gemma4 (Gemma4ForCausalLM)"
    assert lines[1] == f"  fast decode step: yes, memra's gemma4-moe step ({MOE_REASON})"
    # per layer 2 of 8 experts: gate_up [128, 64] and down [64, 64], 2 bytes a weight in bf16, 34 a 32 in Q8_0
    assert lines[-1] == ("  experts: dequantised at load (3-D tensors: no packed form), a token reads 294,912 B of "
                         "them in bfloat16 (156,672 B as shipped)")
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["step"] == {"value": "gemma4-moe", "reason": MOE_REASON}
    tensors = engine.runtime_choices["tensors"]["reason"]
    assert ("experts.gate_up_proj Q8_0 x6: dense float32 (3-D expert tensors, dequantised: no packed form; a token "
            "reads 393,216 B of them (104,448 B as shipped))") in tensors




def test_a_moe_gemma4_gguf_with_a_layer_without_experts_is_refused_by_name(tmp_path):
    """llama.cpp lets a layer go without experts (no ffn_gate_inp); transformers' Gemma 4 has them in
    every layer or none, so the load names what the file leaves unfilled."""
    from memrad.engine.model.pull import ModelUnavailable

    path, _ = write_moe(tmp_path, drop=tuple(f"blk.5.{name}" for name in (
        "ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")))
    with pytest.raises(ModelUnavailable, match=r"fills no tensor for model.layers.5.experts.down_proj, "
                                               r"model.layers.5.experts.gate_up_proj, .* and 4 more"):
        from_gguf(path)
