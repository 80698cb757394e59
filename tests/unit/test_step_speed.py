"""`memrad bench arch-steps`: each architecture's tiny model decodes on its own step, and the
harness prints one row per architecture with the step that ran."""

from memrad import cli
from memrad.engine.decode.step_speed import SHAPES, measure


def test_each_architecture_is_timed_on_its_own_step():
    speeds = [measure(arch, "float32", steps=6) for arch in SHAPES]
    assert [(s.arch, s.step, s.dtype, s.steps) for s in speeds] == [
        ("llama", "llama", "float32", 6), ("qwen3", "qwen3", "float32", 6), ("phi3", "phi3", "float32", 6),
        ("gemma2", "gemma2", "float32", 6), ("qwen3_moe", "qwen3-moe", "float32", 6), ("gemma4", "gemma4", "float32", 6),
        ("gemma4_moe", "gemma4-moe", "float32", 6), ("lfm2", "lfm2", "float32", 6), ("gpt_oss", "gpt-oss", "float32", 6)]
    assert all(s.step_ms > 0 and s.forward_ms > 0 and s.ratio == s.forward_ms / s.step_ms for s in speeds)
    # fp32, 2 sparse layers: router 8 x 256, experts 8 x (1536 x 256 + 256 x 768), 2 of them read a token
    router, expert = 8 * 256 * 4, (1536 * 256 + 256 * 768) * 4
    # gpt-oss, 4 layers: router 8 x 256 and its bias; an expert's gate/up 256 x 512, down 256 x 256 and their biases
    oss_router, oss_expert = (8 * 256 + 8) * 4, (256 * 512 + 512 + 256 * 256 + 256) * 4
    # Gemma 4 MoE, 6 layers: the dense MLP (3 x 256 x 256); router 8 x 256, its scale [256] and per-expert scales
    # [8]; an expert's gate_up 256 x 256, down 256 x 128
    mlp, g4_router, g4_expert = 3 * 256 * 256 * 4, (8 * 256 + 256 + 8) * 4, (256 * 256 + 256 * 128) * 4
    assert [s.ffn_bytes for s in speeds] == [None] * 4 + [
        (2 * (router + 2 * expert), 2 * (router + 8 * expert)), None,
        (6 * (mlp + g4_router + 2 * g4_expert), 6 * (mlp + g4_router + 8 * g4_expert)), None,
        (4 * (oss_router + 2 * oss_expert), 4 * (oss_router + 8 * oss_expert))]


def test_the_harness_prints_a_row_per_architecture(capsys):
    assert cli.main(["bench", "arch-steps", "--steps", "6", "--dtype", "float32", "--arch", "qwen3", "gemma2",
                     "qwen3_moe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "dtype=float32 threads=1 steps=6 (median ms a token after a 40-token prompt)"
    assert [line.split()[:2] for line in lines[2:]] == [["qwen3", "qwen3"], ["gemma2", "gemma2"], ["qwen3_moe", "qwen3-moe"]]
    assert lines[4].endswith("  9,232 (36,880)")  # the feed-forward KiB a token reads, every expert's in brackets
