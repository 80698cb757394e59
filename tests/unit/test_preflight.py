"""Said before the wait: what a GGUF will be served as, from its header, before any weight is read.

Tiny GGUFs written by tests/unit/tiny_gguf.py (Q4_K_M's mix of types): the header reader keeps
what gguf-py's reader keeps; the config built from it is the one transformers' GGUF loader
builds; `memrad pull` / `memrad start` print the architecture, the step, the quant of each
tensor kind, the contexts and the KV bytes per token before converting; a Mamba-1 GGUF and an
architecture transformers cannot read are refused with the reason, before anything loads.
"""

import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from memrad import cli
from memrad.engine.kernels import block_gemv
from memrad.engine.model import gguf_header, pull
from memrad.engine.model.gguf_header import LongArray, read_header
from memrad.engine.model.preflight import gguf_config, inspect_gguf
from memrad.engine.model.pull import ModelUnavailable
from tiny import finish_gguf
from tiny_gguf import tiny_gguf

QWEN3_QUANTS = ("token_embd Q8_0; attn_q Q4_K; attn_k Q4_K; attn_v Q4_K; attn_output Q4_K; attn_q_norm F32; "
                "attn_k_norm F32; ffn_gate Q4_K; ffn_up Q4_K; ffn_down Q6_K; attn_norm F32; ffn_norm F32; "
                "output_norm F32; output Q8_0")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    return {arch: tiny_gguf(folder, arch)[0] for arch in ("qwen3", "phi3", "gemma2", "qwen3_moe")}


def _header_only(path, arch):
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    return finish_gguf(writer, path)


def test_the_header_reader_keeps_what_gguf_py_reads_and_counts_the_long_arrays(ggufs, monkeypatch):
    ours, theirs = read_header(ggufs["qwen3"]), GGUFReader(ggufs["qwen3"])
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert [t.kind for t in ours.tensors] == [t.tensor_type.name for t in theirs.tensors]
    assert [t.shape for t in ours.tensors] == [tuple(int(n) for n in t.shape) for t in theirs.tensors]
    assert set(ours.fields) == set(theirs.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "qwen3.block_count", "qwen3.rope.freq_base",
                "qwen3.attention.head_count_kv", "tokenizer.ggml.eos_token_id", "general.architecture"):
        assert ours.fields[key] == theirs.fields[key].contents(), key
    monkeypatch.setattr(gguf_header, "SHORT_ARRAY", 100)  # 400 tokens: a long array now, kept as its length
    assert read_header(ggufs["qwen3"]).fields["tokenizer.ggml.tokens"] == LongArray(400)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "qwen3_moe"])
def test_the_config_is_the_one_transformers_gguf_loader_builds(ggufs, arch):
    from transformers import AutoConfig

    path = ggufs[arch]
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = gguf_config(read_header(path), path).to_dict()
    theirs.pop("_name_or_path", None), ours.pop("_name_or_path", None)
    assert ours == theirs


def test_a_qwen3_gguf_is_described_before_it_loads(ggufs):
    lines = inspect_gguf(ggufs["qwen3"], 0, torch.float32).lines()
    assert lines == [
        "tiny-qwen3.gguf: qwen3 (Qwen3ForCausalLM)",
        "  fast decode step: yes, memra's qwen3 step (Qwen3ForCausalLM layers on one graph: 2 full-attention)",
        f"  quants: {QWEN3_QUANTS}",
        "  context: native 1,024, served 1,024 (native)",
        # 2 layers x K and V x 1 KV head x 128 dims x 2 bytes: bf16 rows under fp32 activations (model.kv_dtype)
        "  KV: 1,024 B/token in bfloat16",
    ]


@pytest.mark.parametrize("arch,layers,quants", [
    ("phi3", "2 full-attention", "token_embd Q8_0; attn_output Q4_K; attn_qkv Q4_K; ffn_up Q4_K; ffn_down Q6_K; "
     "attn_norm F32; ffn_norm F32; output_norm F32; output Q8_0"),  # qkv and gate/up fused, as shipped
    ("gemma2", "2 sliding-window, 2 full-attention", "token_embd Q8_0; attn_q Q4_K; attn_k Q4_K; attn_v Q4_K; "
     "attn_output Q4_K; ffn_gate Q4_K; ffn_up Q4_K; ffn_down Q6_K; attn_norm F32; post_attention_norm F32; "
     "ffn_norm F32; post_ffw_norm F32; output_norm F32")])  # the head tied to token_embd
def test_a_phi3_or_gemma2_gguf_names_its_step_and_quants_before_it_loads(ggufs, arch, layers, quants):
    model_class = {"phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch]
    assert inspect_gguf(ggufs[arch], 0, torch.bfloat16).lines()[:3] == [
        f"tiny-{arch}.gguf: {arch} ({model_class})",
        f"  fast decode step: yes, memra's {arch} step ({model_class} layers on one graph: {layers})",
        f"  quants: {quants}"]


def test_a_qwen3_moe_gguf_says_its_experts_and_their_quants_before_it_loads(ggufs):
    lines = inspect_gguf(ggufs["qwen3_moe"], 0, torch.bfloat16).lines()
    assert lines[:2] == [
        "tiny-qwen3_moe.gguf: qwen3moe (Qwen3MoeForCausalLM)",
        "  fast decode step: yes, memra's qwen3-moe step (Qwen3MoeForCausalLM layers on one graph: 2 full-attention; "
        "experts: top 2 of 8 per token)"]
    assert "ffn_gate_exps Q4_K; ffn_up_exps Q4_K; ffn_down_exps Q6_K; ffn_gate_inp F32" in lines[2]
    assert lines[4] == "  KV: 1,024 B/token in bfloat16"  # 2 layers x K and V x 1 KV head x 128 dims x 2 bytes
    # 2 of 8 experts in 2 layers: gate and up [768, 256] Q4_K (144 B a 256), down [256, 768] Q6_K (210 B)
    dense, shipped = 2 * 2 * 3 * 768 * 256 * 2, 2 * 2 * (2 * 768 * 144 + 768 * 210)
    if block_gemv.why_not() is None:  # the shipped blocks run on memra's kernel (test_qwen3_moe_blocks)
        assert lines[5] == (f"  experts: Q4_K / Q6_K blocks on memra's block kernel ({block_gemv.path()}), the chosen "
                            f"experts only, a token reads {shipped:,} B of them as shipped ({dense:,} B dequantised "
                            "in bfloat16)")
    else:  # without the kernel they stay dense, and the line says what that costs
        assert lines[5].startswith("  experts: dequantised at load (") and lines[5].endswith(
            f"a token reads {dense:,} B of them in bfloat16 ({shipped:,} B as shipped)")


def test_a_gemma2_gguf_served_past_its_length_says_the_scaling_and_its_windows(ggufs):
    preflight = inspect_gguf(ggufs["gemma2"], 4096, torch.bfloat16)
    assert (preflight.context.num_tokens, preflight.context.native_tokens, preflight.context.describe()) == (
        4096, 1024, "yarn x4")
    assert preflight.kv_bytes_per_token == 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 KV heads, 64 dims, bf16
    assert (preflight.window_layers, preflight.window_tokens) == (2, 8)
    assert preflight.lines()[3:] == ["  context: native 1,024, served 4,096 (yarn x4)",
                                     "  KV: 2,048 B/token in bfloat16; 2 sliding-window layers keep at most 8 rows"]
    assert dict(preflight.quants)["ffn_down"] == (("Q6_K", 4),)


def test_pull_prints_it_before_converting(ggufs, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEMRA_DTYPE", "float32")
    seen = []

    def convert(path, progress):
        seen.append(capsys.readouterr().out)
        raise ModelUnavailable("stopped by the test before converting")

    monkeypatch.setattr(pull, "pull_gguf", convert)
    assert cli.main(["pull", str(ggufs["phi3"])]) == 1
    assert seen[0].splitlines()[0] == "tiny-phi3.gguf: phi3 (Phi3ForCausalLM)"
    assert "  quants: token_embd Q8_0; attn_output Q4_K; attn_qkv Q4_K; ffn_up Q4_K; ffn_down Q6_K; " in seen[0]
    assert "stopped by the test" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pull", "start"])
def test_a_mamba_gguf_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cli, "find_running", lambda: None)
    monkeypatch.setattr(pull, "pull_gguf", lambda *_: pytest.fail("converted a refused GGUF"))
    monkeypatch.setattr(cli, "_start_detached", lambda *_: pytest.fail("started a refused GGUF"))
    path = _header_only(tmp_path / "falcon-mamba.gguf", "mamba")
    argv = ["pull", str(path)] if command == "pull" else ["start", "--model", str(path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"memrad: {path} is a mamba model (the Mamba-1 family): in transformers 5.x its "
                          "multi-token forward ignores cached recurrent state")


def test_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path):
    path = _header_only(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(ModelUnavailable, match=r"is a 'rwkv6' GGUF, which transformers' GGUF loader does not "
                                               r"read \(it reads bloom, deci, falcon, gemma2, gemma3, gemma4"):
        inspect_gguf(path, 0, torch.float32)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ModelUnavailable, match="is not a GGUF file"):
        read_header(path)
