"""gpt-oss on memra's decode step: sinks, sliding windows beside full attention, routed experts.

The tiny gpt-oss of tests/unit/tiny.py (build_gpt_oss: four layers, sliding-window (8) and full
attention alternating, a sink logit per head drawn N(0, 1), q/k/v/o biases, YaRN rope, 8 experts
of which 2 a token behind a biased router), saved as a Hugging Face folder and loaded through
memra's loader, and written as a GGUF as llama.cpp ships it (tests/unit/tiny_gguf.py:
write_gpt_oss_gguf: experts MXFP4, attention and embeddings Q8_0) and loaded through memra's own
gpt-oss reader (memrad.engine.model.gguf_gpt_oss), since transformers 5.24's GGUF loader cannot
read gpt-oss's config, experts or sinks (pinned below, so the day it can, a test says so). From
the GGUF every weight is what its blocks dequantise to; conversion keeps the experts' MXFP4 blocks
(the file's bytes), and where memra's block kernel runs a token's step multiplies only its chosen
experts' blocks (memrad.engine.model.block_experts): fed the dense-dequantised step's tokens, its
logits stay within EXPERTS_BOUND of them and pick the same tokens, a row is its own bits batched
and alone, and turns resume bit-identical to cold on it; `memrad status` and the start banner say
the experts run from their MXFP4 blocks (or, under --weights float, dequantised), with the bytes a
token reads as shipped and dense. The GGUF's Q8_0 attention runs as shipped too, on the kernel
memrad.engine.model.kernel_choice picks (int4 hi|lo where AVX512's offline measurement says so). The step is named
in `memrad status`; in bf16 its logits and KV rows are transformers' forward's bit for bit long
past the window (fp32: within 1e-6), from the folder and from the GGUF, and without the sinks
they are not; an expert the token did not choose is never read; an engine resumes turns
bit-identically to their cold runs, and a compacted reply resumes at the sliding windows'
boundary snapshot below it. The batched step gives a request's row the same bits beside any
neighbours and alone (bf16: the one-row step's and the forward's too), and requests in flight
together (two resumed) decode their alone bits; compiled (compile = on, max_batch 2), from the
folder and from the GGUF on the experts' MXFP4 blocks, its 2-row package opens beside the one-row
one, the decoder's check finds a row the compiled one-row step's bits, and two rows decoded side
by side past the window are each the compiled one-row step's bits at every step.
"""

import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize
from transformers import DynamicCache

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode import steps
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.package import INDUCTOR_OPTIONS, options_for
from memrad.engine.decode.steps.gpt_oss import GptOssStep
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.kernels import block_gemv
from memrad.engine.model.block_experts import BlockMoE
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.quant import Q8Linear
from memrad.engine.model.loader import load_model
from stories import make_engine
from test_batching import in_flight_together_as_alone, rows_are_their_own
from test_gemma_step import compiled_turns_equal_cold
from test_gguf_steps import (compacted_reply_resumes_at_its_boundary, compiled_rows_are_the_one_row_steps,  # noqa: F401
                             own_cache, turns_resume_as_cold)
from tiny import GPT_OSS_LAYERS, build_gpt_oss, build_tokenizer
from tiny_gguf import gpt_oss_tensors, tiny_gpt_oss_gguf, write_gpt_oss_gguf

WINDOW = 8  # tests/unit/tiny.py: build_gpt_oss
PROMPT = list(range(5, 25))  # 20 tokens: past the window before the first step
STEPS = 3 * WINDOW  # the window's buffer (2W rows) moves on twice
REASON = ("GptOssForCausalLM layers on one graph: 2 sliding-window, 2 full-attention; "
          "experts: top 2 of 8 per token")
ON_BLOCKS = block_gemv.why_not() is None  # the experts run from their MXFP4 blocks where memra's kernel runs
needs_blocks = pytest.mark.skipif(not ON_BLOCKS, reason=f"memra's block kernel: {block_gemv.why_not()}")


def fresh(tiny_dir, dtype="bfloat16"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir("gpt_oss")), device="cpu", dtype=dtype, progress=lambda _: None)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """(the tiny gpt-oss's GGUF, the model holding what its blocks dequantise to)."""
    return tiny_gpt_oss_gguf(tmp_path_factory.mktemp("gpt-oss-gguf"))


def from_gguf(path, dtype="bfloat16", weights="auto"):
    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype=dtype, progress=lambda _: None, weights=weights)


def primed(loaded, cache, prompt=PROMPT):
    prefill(loaded.model, cache, prompt, 0, 16)
    return cache


def test_transformers_gguf_loader_cannot_read_gpt_oss_back(gguf):
    """Why memra reads gpt-oss's GGUF itself: transformers 5.24's config reader fails on its rope
    keys (a TypeError), and its tensor map places no llama.cpp tensor onto the
    experts' gate_up_proj or either expert bias (llama.cpp's ffn_gate_exps / ffn_up_exps /
    ffn_down_exps and their .bias), its gpt-oss tensor processor is registered as "gpt_oss" but
    looked up by the file's architecture "gpt-oss" (and matches "_projs" names llama.cpp does
    not write), and it expects the sinks as "attn_sinks" where llama.cpp writes
    "attn_sinks.weight". Loaded, those weights are freshly initialised (a MISSING report)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    path, _ = gguf
    with pytest.raises(TypeError):
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = build_gpt_oss(64)
    mapped = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS["gpt_oss"]())
    hf_names = set(mapped.values())
    for missing in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert f"model.layers.0.{missing}" not in hf_names
    assert "gpt-oss" not in TENSOR_PROCESSORS
    assert mapped.get("blk.0.attn_sinks") == "model.layers.0.self_attn.sinks" and "blk.0.attn_sinks.weight" not in mapped


def test_a_gpt_oss_gguf_loads_on_memras_reader_with_the_files_weights(gguf):
    """Every parameter is what the file's blocks dequantise to (the experts from MXFP4: 17 bytes a
    32 weights, gguf-py's own layout), the model is on the gpt-oss step, and the start banner and
    `memrad status` say the experts ship MXFP4 and run from their blocks on memra's kernel (or,
    under --weights float, dequantised), with what a token reads as shipped and dense."""
    from gguf import GGUFReader
    from memrad.engine.model.preflight import inspect_gguf

    path, model = gguf
    shipped = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    for kind in ("gate", "up", "down"):
        experts = shipped[f"blk.0.ffn_{kind}_exps.weight"]
        assert experts.tensor_type.name == "MXFP4" and experts.data.shape[-1] * 32 == experts.shape[0] * 17
    loaded = from_gguf(path, "float32")
    assert type(loaded.model).__name__ == "GptOssForCausalLM"
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    experts = loaded.model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts[:, :, 1::2].transpose(1, 2),  # the up half, as the file ships it
                       torch.from_numpy(dequantize(shipped["blk.0.ffn_up_exps.weight"].data, GGML.MXFP4).copy()))
    assert Engine(loaded, EngineOptions(16, 1)).runtime_choices["step"] == {"value": "gpt-oss", "reason": REASON}
    halved = from_gguf(path).model.model.layers[0].mlp.experts  # every MXFP4 value is a bf16 value
    assert halved.gate_up_proj.dtype == torch.bfloat16 and torch.equal(halved.gate_up_proj.float(), experts)
    # per token, 2 of 8 experts in each of 4 layers: gate_up [64, 64] and down [32, 64] weights each
    path_name = block_gemv.path() if ON_BLOCKS else None
    if ON_BLOCKS:
        assert ("mlp.experts.gate_up_proj MXFP4 x4: MXFP4 blocks (memra block kernel, "
                f"{path_name}, the chosen experts only; a token reads {4 * 2 * 64 * 64 // 32 * 17:,} B of them as "
                f"shipped ({4 * 2 * 64 * 64 * 4:,} B dense float32))") in loaded.tensors.reason
        assert "mlp.experts.down_proj MXFP4 x4: MXFP4 blocks (memra block kernel" in loaded.tensors.reason
        assert "MXFP4 blocks 8" in loaded.tensors.value
        assert "16 Q8_0 / Q5_0 layers and 4 layers' MXFP4 experts from the GGUF" in loaded.weights.reason
    # the Q8_0 attention runs as shipped under auto (int4 hi|lo or memra's blocks, as kernel_choice picks), not dense
    attention = loaded.model.model.layers[0].self_attn
    assert all(isinstance(proj, (Q8Linear, BlockLinear)) for proj in (attention.q_proj, attention.o_proj))
    assert "self_attn.q_proj Q8_0 x4: dense" not in loaded.tensors.reason
    dense = from_gguf(path, "float32", weights="float")
    assert ("mlp.experts.gate_up_proj MXFP4 x4: dense float32 (3-D expert tensors, dequantised: no packed form; "
            f"a token reads {4 * 2 * 64 * 64 * 4:,} B of them ({4 * 2 * 64 * 64 // 32 * 17:,} B as shipped))"
            ) in dense.tensors.reason
    lines = inspect_gguf(path, 0, torch.bfloat16).lines()
    assert lines[1] == f"  fast decode step: yes, memra's gpt-oss step ({REASON})"
    assert "ffn_gate_exps MXFP4; ffn_up_exps MXFP4; ffn_down_exps MXFP4" in lines[2]
    assert lines[4] == f"  KV: {4 * 2 * 2 * 16 * 2:,} B/token in bfloat16; 2 sliding-window layers keep at most 8 rows"
    # 2 of 8 experts in 4 layers: gate, up [32, 64] and down [64, 32] each, MXFP4 17 B a 32 weights
    if ON_BLOCKS:
        assert lines[5] == (f"  experts: MXFP4 blocks on memra's block kernel ({path_name}), the chosen experts only, "
                            f"a token reads {4 * 2 * 3 * 32 * 64 // 32 * 17:,} B of them as shipped "
                            f"({4 * 2 * 3 * 32 * 64 * 2:,} B dequantised in bfloat16)")
    assert inspect_gguf(path, 0, torch.bfloat16, weights="float").lines()[5] == (
        "  experts: dequantised at load (--weights float), a token reads "
        f"{4 * 2 * 3 * 32 * 64 * 2:,} B of them in bfloat16 ({4 * 2 * 3 * 32 * 64 // 32 * 17:,} B as shipped)")


def dense_experts(loaded, sparse_block=None):
    """`loaded` with every layer's experts back on transformers' sparse block (GptOssMLP unless
    given: the same router and dense experts, as --weights float runs them; the attention stays
    as loaded): the reference the experts' blocks are held to."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    for layer in loaded.model.model.layers:
        assert isinstance(layer.mlp, BlockMoE)
        mlp = (sparse_block or GptOssMLP)(loaded.model.config)
        router = layer.mlp.router_name
        setattr(mlp, router, getattr(layer.mlp, router))
        mlp.experts = layer.mlp.experts
        layer.mlp = mlp
    return loaded


@needs_blocks
def test_the_experts_blocks_are_the_files_bytes_and_only_the_chosen_experts_are_read(gguf):
    """Conversion keeps each layer's MXFP4 experts as the file's bytes (gate and up rows
    interleaved as transformers interleaves gate_up_proj's columns); a token's step reads only its
    chosen experts' blocks and biases: every other expert poisoned (scale bytes 255: 2^127, biases
    NaN) leaves its logits' bits alone, and one chosen expert's block poisoned changes them."""
    from gguf import GGUFReader

    path, _ = gguf
    loaded = from_gguf(path, "float32")
    shipped = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in GGUFReader(path).tensors}
    mlp = loaded.model.model.layers[1].mlp
    assert isinstance(mlp, BlockMoE) and mlp.gate_up_blocks.dtype == torch.uint8
    assert torch.equal(mlp.gate_up_blocks[:, 0::2], shipped["blk.1.ffn_gate_exps.weight"])
    assert torch.equal(mlp.gate_up_blocks[:, 1::2], shipped["blk.1.ffn_up_exps.weight"])
    assert torch.equal(mlp.down_blocks, shipped["blk.1.ffn_down_exps.weight"])
    engine = Engine(loaded, EngineOptions(16, 1))
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    clean, poisoned, poisoned_chosen = (primed(loaded, engine.new_cache()) for _ in range(3))
    seen = routes(loaded.model)
    expected = feed(clean, 7, len(PROMPT))
    chosen = {layer: set(ids.view(-1).tolist()) for layer, ids in seen}
    layers = loaded.model.model.layers
    with torch.no_grad():
        for index, layer in enumerate(layers):
            for e in set(range(8)) - chosen[index]:
                layer.mlp.gate_up_blocks[e, :, ::17] = 255
                layer.mlp.down_blocks[e, :, ::17] = 255
                layer.mlp.experts.gate_up_proj_bias[e] = float("nan")
                layer.mlp.experts.down_proj_bias[e] = float("nan")
    assert torch.equal(feed(poisoned, 7, len(PROMPT)), expected)
    with torch.no_grad():
        layers[3].mlp.down_blocks[min(chosen[3]), :, ::17] = 255  # a chosen one: the test can fail
    assert not torch.equal(feed(poisoned_chosen, 7, len(PROMPT)), expected)


EXPERTS_BOUND = 4e-3  # of the dense logits' largest |.|: measured 1.1e-3 (EPYC, AVX512 path) over these steps


@needs_blocks
def test_the_step_on_the_experts_blocks_decodes_the_dense_steps_tokens_within_the_bound(gguf):
    """From the same GGUF in float32, the step whose experts run their MXFP4 blocks (the kernel
    rounds each activation to int16 per block of 32: 2^-16 of its largest |x|, the sums float32)
    and the step on the dense dequantised experts: the same prefill bits (prefill runs the dense
    experts either way), then, fed the dense run's tokens for 24 steps past the window, logits
    within EXPERTS_BOUND of the dense ones' largest and the same greedy token at every step, so
    both decode the same tokens. The kernel's own bound per product: tests/unit/test_block_linear.py."""
    worst = worst_against_dense(from_gguf(gguf[0], "float32"), dense_experts(from_gguf(gguf[0], "float32")),
                                PROMPT, STEPS)
    assert 0.0 < worst <= EXPERTS_BOUND, worst  # rounded (the blocks did run), within the bound


def worst_against_dense(blocks, dense, prompt, steps: int) -> float:
    """`blocks` (experts on their blocks) and `dense` (the same model on the dense experts): the
    same prefill bits after `prompt`, then, fed the dense run's greedy tokens for `steps` steps,
    the same greedy token at every step; returns the largest |logit difference| over the dense
    logits' largest |.|."""
    feeds = [Decoder(m.model, m.context_len, m.device).feeder() for m in (blocks, dense)]
    caches = [Engine(m, EngineOptions(16, 1)).new_cache() for m in (blocks, dense)]
    a, b = (prefill(m.model, cache, prompt, 0, 16) for m, cache in zip((blocks, dense), caches))
    assert torch.equal(a, b)
    worst = 0.0
    for step in range(steps):
        token = int(b.argmax())
        a, b = (feed(cache, token, len(prompt) + step) for feed, cache in zip(feeds, caches))
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
        assert int(a.argmax()) == int(b.argmax()), step
    return worst


@needs_blocks
def test_a_gpt_oss_request_on_the_experts_blocks_is_the_same_bits_batched_and_alone(gguf):
    """The experts' blocks run one fixed sequence of operations per output: a request's row on the
    batched step is its own bits beside any neighbours, the one-row step's and the forward's."""
    loaded = from_gguf(gguf[0])
    assert isinstance(loaded.model.model.layers[0].mlp, BlockMoE)
    engine = make_engine(loaded, 16, max_batch=4)
    first = rows_are_their_own(engine, loaded.model, 16)
    prompt = list(range(5, 45))
    for decode in (engine.decoder.feeder(), lambda cache, token, at: decode_one_token(loaded.model, cache, token, at)):
        cache = engine.new_cache()
        prefill(loaded.model, cache, prompt, 0, 16)
        assert torch.equal(decode(cache, 11, len(prompt)).float(), first)
    in_flight_together_as_alone(from_gguf(gguf[0]))


def test_a_gpt_oss_gguf_with_a_tensor_memra_does_not_place_is_refused(tmp_path):
    """A fused gate/up tensor (a layout memra's table does not name) is refused by name, never
    loaded as half-initialised weights."""
    from memrad.engine.model.pull import ModelUnavailable

    path, model = tiny_gpt_oss_gguf(tmp_path)
    (tmp_path / "fused").mkdir()
    fused = tmp_path / "fused" / "tiny-gpt-oss.gguf"
    extra = [("blk.0.ffn_gate_up_exps.weight", model.model.layers[0].mlp.experts.gate_up_proj, GGML.F32)]
    write_gpt_oss_gguf(fused, model, build_tokenizer(), tensors=gpt_oss_tensors(model) + extra)
    with pytest.raises(ModelUnavailable, match="blk.0.ffn_gate_up_exps.weight"):
        from_gguf(fused)


def test_gpt_oss_is_on_its_step_and_says_so(tiny_dir):
    loaded = fresh(tiny_dir)
    model = loaded.model
    assert type(model).__name__ == "GptOssForCausalLM" and model.config.layer_types == GPT_OSS_LAYERS
    assert model.config._attn_implementation == "eager"  # prefill keeps the sinks (memra's kernel has none)
    assert steps.support(model, loaded.context_len) is None
    assert steps.describe(model, loaded.context_len) == steps.Choice("gpt-oss", REASON)
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["step"] == {"value": "gpt-oss", "reason": REASON}  # what `memrad status` shows
    step = engine.decoder.eager_step
    assert type(step) is GptOssStep and steps.has_batched(step)
    assert options_for(step) == INDUCTOR_OPTIONS  # rounded as its compiled batched twin is
    assert steps.windows(step) == [WINDOW, None, WINDOW, None] and not any(steps.recurrent(step))
    assert [type(layer).__name__ for layer in engine.new_cache().layers] == ["WindowLayer", "SlabLayer"] * 2
    assert model.model.rotary_emb.rope_type == "yarn" and model.model.rotary_emb.attention_scaling != 1.0
    assert tuple(step.cos.shape[1:]) == (8,)  # gpt-oss's tables: half a head of 16 wide


@pytest.mark.parametrize("source", ["folder", "gguf"])
@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.0), ("float32", 1e-6)])
def test_the_gpt_oss_step_decodes_transformers_bits_past_the_window(tiny_dir, gguf, source, dtype, tolerance):
    loaded = fresh(tiny_dir, dtype) if source == "folder" else from_gguf(gguf[0], dtype)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = Engine(loaded, EngineOptions(16, 1)).new_cache(), DynamicCache(config=loaded.model.config)
    a, b = prefill(loaded.model, ours, PROMPT, 0, 16), prefill(loaded.model, theirs, PROMPT, 0, 16)
    assert torch.equal(a, b)  # WindowLayers and slabs leave prefill's bits alone
    for step in range(STEPS):
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        if tolerance == 0.0:
            assert torch.equal(a, b), (step, float((a - b).abs().max()))
        else:
            assert float((a - b).abs().max()) <= tolerance, (step, float((a - b).abs().max()))
    assert ours.get_seq_length() == theirs.get_seq_length() == len(PROMPT) + STEPS
    for index, kind in enumerate(GPT_OSS_LAYERS):  # the step's KV rows: the whole slab, the window's W - 1
        mine, forward = ours.layers[index], theirs.layers[index]
        assert mine.keys.shape == forward.keys.shape
        assert mine.keys.shape[-2] == (WINDOW - 1 if kind == "sliding_attention" else len(PROMPT) + STEPS)
        for rows, their_rows in ((mine.keys, forward.keys), (mine.values, forward.values)):
            assert (torch.equal(rows, their_rows) if tolerance == 0.0
                    else torch.allclose(rows, their_rows, rtol=0.0, atol=tolerance)), (index, kind)


def test_the_step_adds_the_sinks_to_the_softmax(tiny_dir):
    """A step without sinks (every sink -inf: no weight on "nothing") decodes other bits, so the
    bit-for-bit test above can fail."""
    loaded = fresh(tiny_dir)
    engine = Engine(loaded, EngineOptions(16, 1))
    cache = primed(loaded, engine.new_cache())
    expected = decode_one_token(loaded.model, cache, 7, len(PROMPT))
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device)
    assert torch.equal(decoder.feeder()(primed(loaded, engine.new_cache()), 7, len(PROMPT)), expected)
    for layer in decoder.eager_step.layers:
        layer.sinks = torch.nn.Parameter(torch.full_like(layer.sinks, float("-inf")), requires_grad=False)
    dropped = decoder.feeder()(primed(loaded, engine.new_cache()), 7, len(PROMPT))
    assert not torch.isnan(dropped).any() and not torch.equal(dropped, expected)


def routes(model):
    """Record every router call of `model`: a list that fills with (layer, ids [1, k])."""
    seen = []
    for index, layer in enumerate(model.model.layers):
        def hook(_module, _args, out, index=index):
            seen.append((index, out[2].clone()))  # GptOssTopKRouter: (logits, scores, indices)
        layer.mlp.router.register_forward_hook(hook)
    return seen


def test_an_expert_the_token_did_not_choose_is_never_read(tiny_dir):
    loaded = fresh(tiny_dir, "float32")
    engine = Engine(loaded, EngineOptions(16, 1))
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    clean, poisoned, poisoned_chosen = (primed(loaded, engine.new_cache()) for _ in range(3))  # the prompt read all
    seen = routes(loaded.model)
    expected = feed(clean, 7, len(PROMPT))
    chosen = {layer: set(ids.view(-1).tolist()) for layer, ids in seen}
    assert len(seen) == 4 and all(len(ids) == 2 for ids in chosen.values())
    layers = loaded.model.model.layers
    with torch.no_grad():
        for index, layer in enumerate(layers):
            experts = layer.mlp.experts
            for e in set(range(8)) - chosen[index]:  # weights and biases alike
                for tensor in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                               experts.down_proj_bias):
                    tensor[e] = float("nan")
    assert torch.equal(feed(poisoned, 7, len(PROMPT)), expected)
    with torch.no_grad():
        layers[3].mlp.experts.down_proj_bias[min(chosen[3])] = float("nan")  # a chosen one: the test can fail
    assert torch.isnan(feed(poisoned_chosen, 7, len(PROMPT))).all()


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_a_gpt_oss_engine_resumes_turns_bit_identical_to_cold(tiny_dir, gguf, source):
    loaded = fresh(tiny_dir) if source == "folder" else from_gguf(gguf[0])
    turns_resume_as_cold(make_engine(loaded, 16, max_sessions=16, mode="exact"))


def test_a_rewritten_reply_resumes_from_the_windows_boundary_snapshot_below_it(tiny_dir):
    """A sliding window cannot be cut back (its older rows are gone): a client that compacts
    turn 2's reply resumes at the snapshot taken at that reply's anchor, far past the window,
    and its turn is the cold run's bit for bit."""
    anchors = compacted_reply_resumes_at_its_boundary(make_engine(fresh(tiny_dir), 16, max_sessions=16, mode="exact"))
    assert anchors[1] > 4 * WINDOW


def test_every_row_of_the_batched_gpt_oss_step_is_its_own_and_the_one_row_steps(tiny_dir):
    """Each row attends its own slab and window view and is routed on its own: a request's row is
    the same bits beside any neighbours and alone, and in bf16 the one-row step and transformers'
    forward give it those bits."""
    loaded = fresh(tiny_dir)
    engine = make_engine(loaded, 16, max_batch=4)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    first = rows_are_their_own(engine, loaded.model, 16)
    prompt = list(range(5, 45))  # rows_are_their_own's first prompt, past the window
    for decode in (engine.decoder.feeder(), lambda cache, token, at: decode_one_token(loaded.model, cache, token, at)):
        cache = engine.new_cache()
        prefill(loaded.model, cache, prompt, 0, 16)
        assert torch.equal(decode(cache, 11, len(prompt)).float(), first)
    step = engine.decoder.batch_step(4)
    assert step.alone is not None and [twin.rows for twin in step.smaller] == [2]  # checked: the same bits


def test_gpt_oss_requests_in_flight_together_decode_their_bits_alone(tiny_dir):
    """Four requests, two resumed from parked sessions, decoding on the batched step together:
    each one's tokens, first logits and every step's scores as when it runs alone."""
    in_flight_together_as_alone(fresh(tiny_dir))


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_gpt_oss_step_resumes_bit_identical_and_decodes_as_the_eager_one(tiny_dir):
    """compile = on, max_batch 2: the one-row package and the 2-row one are built (minutes on a
    shared 2-core machine; each row's window views their own symbol, as Gemma's) and open, the
    decoder's check finding a compiled batched row the compiled one-row step's bits; turns resume
    on them bit-identical to their cold runs. The compiled step rounds
    fused work otherwise than the eager one (bf16), and the tiny model's flat router has near
    ties (2nd and 3rd logits one bf16 ulp apart) that such rounding flips a few steps in, so the
    two are compared one step at a time from the same primed state, before the window fills and
    past it."""
    loaded = fresh(tiny_dir)
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
    compiled_turns_equal_cold(engine)  # starts the build, checks the choice, holds a conversation
    compiled_rows_are_the_eager_ones_within_rounding(engine, loaded)


def compiled_rows_are_the_eager_ones_within_rounding(engine, loaded) -> None:
    """`engine`'s compiled packages (one row and 2 rows, built): two rows on the 2-row graph, one
    past the window and one inside it until it fills, each the compiled one-row step's bits; and
    the compiled one-row step within bf16 rounding of the eager one, before the window fills and
    past it."""
    compiled_rows_are_the_one_row_steps(engine, (PROMPT, PROMPT[:5]), 2 * WINDOW)
    decoder = engine.decoder
    eager = Decoder(loaded.model, loaded.context_len, loaded.device, "off").feeder()
    for prompt in (PROMPT[:5], PROMPT):
        ours, theirs = (primed(loaded, engine.new_cache(), prompt) for _ in range(2))
        a, b = decoder.feeder()(ours, 7, len(prompt)), eager(theirs, 7, len(prompt))
        assert float((a - b).abs().max()) <= 0.0625, (len(prompt), float((a - b).abs().max()))  # bf16 rounding


@needs_blocks
@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_gpt_oss_steps_on_the_experts_blocks_resume_and_batch_bit_identical(gguf):
    """compile = on from the GGUF, max_batch 2: the one-row and 2-row packages export the chosen
    experts' blocks (each row's expert ids unbacked sizes from `.item()`, as Qwen3-Next's) and open
    (minutes on a shared 2-core machine); turns resume on them bit-identical to their cold runs,
    and a row of the compiled 2-row step is the compiled one-row step's bits beside a neighbour
    and alone, step after step past the window."""
    loaded = from_gguf(gguf[0])
    assert isinstance(loaded.model.model.layers[0].mlp, BlockMoE)
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
    compiled_turns_equal_cold(engine)
    compiled_rows_are_the_eager_ones_within_rounding(engine, loaded)
