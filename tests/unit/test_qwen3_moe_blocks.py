"""Qwen3-MoE's experts from their shipped blocks on memra's kernel (memrad.engine.model.block_experts).

The tiny Qwen3-MoE of tests/unit/tiny_gguf.py (2 layers, 8 experts of 768, 2 a token) written as
a Q4_K_M file ships its experts as llama.cpp does: gate and up Q4_K, down Q6_K; a second file
ships them Q8_0, a third Q4_0 (a kind the block kernel does not run as shipped). Conversion keeps
the experts' blocks as the file's bytes (gate rows, then up rows: transformers' gate_up_proj), and
where memra's kernel runs each layer's sparse block is a BlockMoE: the model's router (its choice
and weights exactly the forward's) and, for one token, the chosen experts' blocks on the kernel.
Held here: the blocks are the file's bytes bit for bit and only the chosen experts' are read
(every other expert's blocks and every dense expert weight poisoned leave the logits' bits; one
chosen expert's blocks poisoned change them); the step on the blocks decodes the dense-dequantised
step's greedy tokens for 24 steps with logits within EXPERTS_BOUND (bf16, fp32; measured); a row's
bits are its own batched and alone, at 1 and 2 threads; resumed turns are the cold run's; the
start banner and `memrad status` say where the experts run and what a token reads as shipped.
Compiled (the one-row and 2-row packages over the experts' blocks, this Q4_K_M file's model): in
tests/unit/test_gguf_steps.py, whose Qwen3-MoE is this one (tiny_gguf, seed 0, the same kinds).
"""

import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader

from memrad.engine.forward import decode_one_token
from memrad.engine.kernels import block_gemv
from memrad.engine.model.block_experts import BlockMoE
from memrad.engine.model.loader import load_model
from memrad.engine.model.preflight import inspect_gguf
from stories import make_engine
from test_batching import in_flight_together_as_alone, rows_are_their_own
from test_experts import PROMPT, primed, primed_and_chosen
from test_gpt_oss import dense_experts, worst_against_dense
from test_gguf_steps import turns_resume_as_cold
from tiny_gguf import kind_for, tiny_gguf

STEPS = 24
EXPERTS, WIDTH, HIDDEN, LAYERS = 8, 768, 256, 2
pytestmark = pytest.mark.skipif(block_gemv.why_not() is not None, reason=f"memra's block kernel: {block_gemv.why_not()}")


def experts_as(kind):
    """A Q4_K_M file's types with every expert tensor `kind`."""
    return lambda name, shape: kind if "_exps" in name else kind_for(name, shape)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{"Q4_K_M": Q4_K / Q4_K / Q6_K experts, "Q8_0": ..., "Q4_0": ...}: each tiny Qwen3-MoE's GGUF."""
    kinds = {"Q4_K_M": kind_for, "Q8_0": experts_as(T.Q8_0), "Q4_0": experts_as(T.Q4_0)}
    return {name: tiny_gguf(tmp_path_factory.mktemp(f"qwen3-moe-{name}"), "qwen3_moe", kinds=kind)[0]
            for name, kind in kinds.items()}


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # one conversion per file for the module
        patch.setenv("MEMRA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def fresh(path, dtype="bfloat16", weights="auto"):
    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype=dtype, weights=weights, progress=lambda _: None)


@pytest.mark.parametrize("file,kinds", [("Q4_K_M", ("Q4_K", "Q6_K")), ("Q8_0", ("Q8_0", "Q8_0"))])
def test_the_experts_blocks_are_the_files_bytes_and_only_the_chosen_experts_are_read(ggufs, file, kinds):
    """Each layer's experts are the file's bytes (gate rows then up rows); a token's step reads
    only its chosen experts' blocks: every other expert's blocks poisoned (every byte 255: d is
    NaN) and every dense expert weight NaN leave its logits' bits alone, and one chosen expert's
    blocks poisoned change them."""
    path = ggufs[file]
    loaded = fresh(path, "float32")
    shipped = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in GGUFReader(path).tensors}
    layers = loaded.model.model.layers
    for index, layer in enumerate(layers):
        mlp = layer.mlp
        assert isinstance(mlp, BlockMoE) and (mlp.gate_up_kind, mlp.down_kind) == kinds
        assert torch.equal(mlp.gate_up_blocks[:, :WIDTH], shipped[f"blk.{index}.ffn_gate_exps.weight"])
        assert torch.equal(mlp.gate_up_blocks[:, WIDTH:], shipped[f"blk.{index}.ffn_up_exps.weight"])
        assert torch.equal(mlp.down_blocks, shipped[f"blk.{index}.ffn_down_exps.weight"])
    feed, poisoned, poisoned_chosen, expected, chosen = primed_and_chosen(loaded)
    with torch.no_grad():
        for index, layer in enumerate(layers):
            layer.mlp.experts.gate_up_proj.fill_(float("nan"))
            layer.mlp.experts.down_proj.fill_(float("nan"))
            for e in set(range(EXPERTS)) - chosen[index]:
                layer.mlp.gate_up_blocks[e] = 255
                layer.mlp.down_blocks[e] = 255
    assert torch.equal(feed(poisoned, 7, len(PROMPT)), expected)
    with torch.no_grad():
        layers[1].mlp.down_blocks[min(chosen[1])] = 255  # a chosen one: the test can fail
    assert not torch.equal(feed(poisoned_chosen, 7, len(PROMPT)), expected)


# Of the dense logits' largest |.|, over 24 steps: measured (EPYC Zen 4, AVX512 path) on the
# Q4_K_M file 2.2e-5 in fp32 and 6.8e-3 in bf16 (there the experts' bf16 outputs round apart too).
EXPERTS_BOUND = {"float32": 1e-4, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_step_on_the_experts_blocks_decodes_the_dense_steps_tokens_within_the_bound(ggufs, dtype):
    """The step whose experts run their blocks (the kernel rounds each activation to int16 per
    block of 32, the sums float32) and the step on the dense dequantised experts, from the same
    GGUF: the same prefill bits (prefill runs the dense experts either way), then, fed the dense
    run's tokens for 24 steps, logits within EXPERTS_BOUND of the dense ones' largest and the same
    greedy token at every step."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    path = ggufs["Q4_K_M"]
    dense = dense_experts(fresh(path, dtype), Qwen3MoeSparseMoeBlock)
    worst = worst_against_dense(fresh(path, dtype), dense, PROMPT, STEPS)
    assert 0.0 < worst <= EXPERTS_BOUND[dtype], worst  # rounded (the blocks did run), within the bound


def test_a_request_on_the_experts_blocks_is_the_same_bits_batched_alone_and_on_two_threads(ggufs):
    """The blocks run one fixed sequence of operations per output: a request's row on the batched
    step is its own bits beside any neighbours, the one-row step's and the forward's, and the same
    at 2 threads as at 1; requests in flight together decode their bits alone."""
    loaded = fresh(ggufs["Q4_K_M"])
    assert isinstance(loaded.model.model.layers[0].mlp, BlockMoE)
    engine = make_engine(loaded, 16, max_batch=4)
    first = rows_are_their_own(engine, loaded.model, 16)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for decode in (engine.decoder.feeder(),
                       lambda cache, token, at: decode_one_token(loaded.model, cache, token, at)):
            assert torch.equal(decode(primed(loaded, engine), 11, len(PROMPT)).float(), first), threads
    torch.set_num_threads(1)
    in_flight_together_as_alone(fresh(ggufs["Q4_K_M"]))


def test_a_qwen3_moe_engine_on_the_experts_blocks_resumes_turns_bit_identical_to_cold(ggufs):
    loaded = fresh(ggufs["Q4_K_M"])
    assert isinstance(loaded.model.model.layers[1].mlp, BlockMoE)
    turns_resume_as_cold(make_engine(loaded, 16, max_sessions=16, mode="exact"))


def test_the_banner_and_status_say_the_experts_run_from_their_blocks_and_what_a_token_reads(ggufs):
    """`memrad status` (the tensors' groups) and the start banner (the preflight's experts line)
    say the experts run as shipped on memra's kernel, with the bytes a token reads of them as
    shipped and dequantised; a Q4_0 file's (a kind the kernel does not run as shipped) and
    --weights float's stay dequantised and say why."""
    path, k = ggufs["Q4_K_M"], 2
    loaded = fresh(path, "float32")
    path_name = block_gemv.path()
    gate_up, down = 2 * WIDTH * HIDDEN, HIDDEN * WIDTH  # weights an expert has of each
    assert ("mlp.experts.gate_up_proj Q4_K x2: Q4_K blocks (memra block kernel, "
            f"{path_name}, the chosen experts only; a token reads {LAYERS * k * gate_up // 256 * 144:,} B of them as "
            f"shipped ({LAYERS * k * gate_up * 4:,} B dense float32))") in loaded.tensors.reason
    assert ("mlp.experts.down_proj Q6_K x2: Q6_K blocks (memra block kernel, "
            f"{path_name}, the chosen experts only; a token reads {LAYERS * k * down // 256 * 210:,} B of them as "
            f"shipped ({LAYERS * k * down * 4:,} B dense float32))") in loaded.tensors.reason
    shipped = LAYERS * k * (gate_up // 256 * 144 + down // 256 * 210)
    assert inspect_gguf(path, 0, torch.bfloat16).lines()[5] == (
        f"  experts: Q4_K / Q6_K blocks on memra's block kernel ({path_name}), the chosen experts only, "
        f"a token reads {shipped:,} B of them as shipped ({LAYERS * k * (gate_up + down) * 2:,} B dequantised in bfloat16)")
    assert inspect_gguf(path, 0, torch.bfloat16, weights="float").lines()[5] == (
        f"  experts: dequantised at load (--weights float), a token reads {LAYERS * k * (gate_up + down) * 2:,} B "
        f"of them in bfloat16 ({shipped:,} B as shipped)")
    assert inspect_gguf(ggufs["Q4_0"], 0, torch.bfloat16).lines()[5].startswith(
        "  experts: dequantised at load (Q4_0: a kind memra's block kernel does not run), a token reads ")
    q4_0 = fresh(ggufs["Q4_0"])
    assert not any(isinstance(layer.mlp, BlockMoE) for layer in q4_0.model.model.layers)
    assert "mlp.experts.gate_up_proj Q4_0 x2: dense bfloat16 (3-D expert tensors" in q4_0.tensors.reason
