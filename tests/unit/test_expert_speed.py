"""`memrad bench experts`: one layer's experts for one token (gpt-oss's MXFP4, Qwen3-MoE's Q4_K /
Q6_K), dense against their blocks on the same weights, and the bytes a token reads of them each way."""

import pytest
import torch

from memrad import cli
from memrad.engine.decode.expert_speed import measure, sparse_block
from memrad.engine.kernels import block_gemv
from memrad.engine.model.block_experts import BlockMoE

pytestmark = pytest.mark.skipif(block_gemv.why_not() is not None, reason=str(block_gemv.why_not()))


def test_both_arms_multiply_the_same_weights_and_the_bytes_are_k_of_e_experts():
    mlp, blocks = sparse_block("tiny", torch.float32)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        dense, _ = mlp(x)
        on_blocks, _ = BlockMoE(mlp, blocks)(x)
    assert not torch.equal(dense, on_blocks)  # the kernel rounds the activation: the arms are not one
    assert torch.allclose(dense, on_blocks, rtol=0, atol=1e-3 * float(dense.abs().max()))
    speed = measure("tiny", "float32", reps=4)
    # 2 of 8 experts: gate_up [64, 64] and down [32, 64] weights, float32 dense, 17 B a 32 as shipped
    assert (speed.dense_bytes, speed.shipped_bytes) == (2 * (64 * 64 + 32 * 64) * 4, 2 * (64 * 64 + 32 * 64) // 32 * 17)
    assert speed.dense_ms > 0 and speed.blocks_ms > 0 and speed.ratio == speed.dense_ms / speed.blocks_ms


def test_the_harness_prints_a_row_per_shape(capsys):
    assert cli.main(["bench", "experts", "--reps", "4", "--dtype", "float32", "--shape", "tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "dtype=float32 threads=1 reps=4 (median ms a token, one layer)"
    assert lines[2].split()[0] == "tiny" and lines[2].endswith("  49,152, 6,528")


def test_qwen3_moes_arms_multiply_the_same_k_quant_weights():
    """Qwen3-MoE's sparse block on Q4_K gate / up and Q6_K down blocks: both arms the same weights
    (within the kernel's activation rounding), the bytes 2 of 8 experts' each way."""
    mlp, parts = sparse_block("q3-tiny", torch.float32)
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        dense, on_blocks = mlp(x), BlockMoE(mlp, parts)(x)
    assert not torch.equal(dense, on_blocks) and torch.allclose(dense, on_blocks, rtol=0,
                                                                 atol=1e-3 * float(dense.abs().max()))
    speed = measure("q3-tiny", "float32", reps=4)
    # gate_up [512, 256] Q4_K (144 B a 256 weights) and down [256, 256] Q6_K (210 B) an expert
    assert (speed.dense_bytes, speed.shipped_bytes) == (2 * (512 * 256 + 256 * 256) * 4, 2 * (512 * 144 + 256 * 210))
