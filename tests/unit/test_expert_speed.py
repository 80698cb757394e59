"""`memrad bench experts`: one gpt-oss layer's experts for one token, dense against their MXFP4
blocks on the same weights, and the bytes a token reads of them each way."""

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
