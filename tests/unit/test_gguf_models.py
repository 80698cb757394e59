"""The architectures agents run, from a GGUF, through memra's own GGUF path (no hub).

Each tiny model of tests/unit/tiny_gguf.py is written as a Q4_K_M-like GGUF and loaded with
memrad.engine.model.loader.load_model, which converts it (memrad.engine.model.pull.pull_gguf) and
keeps its blocks: float weights bit-identical to what the GGUF holds, the Q8_0 head, the Q4_K and
Q6_K projections on memra's block kernel where it is the faster (the timing fixed here), a
mixture of experts' 3-D tensors dense with the reason, and the tokenizer
and chat template as written (the byte-level BPE read back as written, except for Gemma 2, whose
GGUF vocabulary transformers reads as SentencePiece, as real Gemma GGUFs ship it).
"""

import pytest
import torch

from memrad.engine.kernels import block_gemv
from memrad.engine.model import kernel_choice
from memrad.engine.model.loader import load_model
from tiny import build_tokenizer
from tiny_gguf import ARCHITECTURES, tiny_gguf

CLASSES = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "lfm2": "Lfm2ForCausalLM"}
# What each tiny model's tensors run as on `auto`, with memra's block kernel measured the faster
# wherever it is measured (Qwen3-MoE's 3-D experts run their Q4_K / Q6_K blocks, the chosen
# experts only: memrad.engine.model.formats says what a token reads of them)
TENSORS = {"qwen3": "Q8_0 blocks 1, Q6_K blocks 2, Q4_K blocks 12",
           "phi3": "Q8_0 blocks 1, Q6_K blocks 2, Q4_K blocks 6",
           "gemma2": "Q8_0 blocks 1, Q6_K blocks 4, Q4_K blocks 24",
           "qwen3_moe": "Q8_0 blocks 1, Q6_K blocks 2, Q4_K blocks 10",
           "lfm2": "Q8_0 blocks 1, Q4_K blocks 28, Q6_K blocks 6"}
DOWN = {"qwen3": ("mlp.down_proj", 2), "phi3": ("mlp.down_proj", 2), "gemma2": ("mlp.down_proj", 4),
        "lfm2": ("feed_forward.w2", 6)}  # each one's Q6_K projections


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-models")
    return {arch: tiny_gguf(folder, arch) for arch in ARCHITECTURES}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_gguf_loads_through_memras_path_bit_identical_to_what_it_holds(written, arch):
    path, model = written[arch]
    loaded = load_model(str(path), device="cpu", dtype="float32", weights="float", progress=lambda _: None)
    assert type(loaded.model).__name__ == CLASSES[arch]
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    tokenizer = build_tokenizer()
    text = "<|im_start|>user\ndef add(a, b):<|im_end|>\n"
    if arch != "gemma2":  # transformers reads a gemma GGUF's vocabulary as SentencePiece, not byte-level BPE
        assert loaded.tokenizer(text).input_ids == tokenizer(text).input_ids
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    assert loaded.eos_ids == frozenset({2})


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_its_quants_run_as_shipped_and_say_which_stay_dense(written, arch, monkeypatch):
    # the block kernel wins: interleaved where the group has that arm (AVX2 measures the Q4_x / Q8_0 groups too)
    monkeypatch.setattr(kernel_choice, "_fastest", lambda *calls: (1e-6, 2e-6) if len(calls) == 2 else (2e-6, 4e-6, 1e-6))
    path, _ = written[arch]
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", weights="auto", progress=lambda _: None)
    assert loaded.weights.value == "int4"
    head = "Q8_0 x16 blocks 1" if block_gemv.interleaves() else "Q8_0 blocks 1"  # AVX512: its rows 16 side by side
    assert loaded.tensors.value == TENSORS[arch].replace("Q8_0 blocks 1", head)
    if arch in DOWN:
        name, count = DOWN[arch]
        assert (f"{name} Q6_K x{count}: Q6_K blocks (memra block kernel, {block_gemv.path()}, 2.0x dense bfloat16 "
                "(measured at load, one row))") in loaded.tensors.reason
    else:  # Qwen3-MoE: the 3-D experts on their blocks, and what a token reads of them (2 of 8, 2 layers)
        # as shipped: Q6_K 210 bytes a 256 weights, Q4_K 144 (tests/unit/test_qwen3_moe_blocks.py)
        on = f"memra block kernel, {block_gemv.path()}, the chosen experts only; a token reads"
        assert (f"mlp.experts.down_proj Q6_K x2: Q6_K blocks ({on} {2 * 2 * 768 * 210:,} B of them as shipped "
                f"({2 * 2 * 256 * 768 * 2:,} B dense bfloat16))") in loaded.tensors.reason
        assert (f"mlp.experts.gate_up_proj Q4_K x2: Q4_K blocks ({on} {2 * 2 * 1536 * 144:,} B of them as shipped "
                f"({2 * 2 * 1536 * 256 * 2:,} B dense bfloat16))") in loaded.tensors.reason
    assert f"lm_head Q8_0 x1: {head.removesuffix(' 1')}" in loaded.tensors.reason
