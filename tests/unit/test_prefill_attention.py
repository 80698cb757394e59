"""memra's prefill attention: what the kernel computes over a chunk and a long cache, that its
bits do not depend on the thread count, what it refuses, when a model gets it and why not,
and that a model running it still resumes bit-identically to its cold run.

The reference is float64 attention over the same rows with the causal mask transformers builds
for a chunk after a cache; the kernel is handed slab views whose rows past the end are stale.
"""

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import stories
from memrad.engine.kernels import prefill_attention
from memrad.engine.forward import prefill
from memrad.engine.model import attention
from memrad.engine.model.loader import load_model
from memrad.engine.state.disk import state_format
from tiny import build_tokenizer

AMX = prefill_attention.has_amx()
needs_kernel = pytest.mark.skipif(not AMX or prefill_attention.load() is not None,
                                  reason="the kernel runs on AMX tiles and is built with a C++ compiler")


def chunk(heads, group, dim, queries, rows, seed):
    """q [1, H_q, T, D] as transformers hands it (a transposed view), keys and values [1, H_kv, L, D]
    as slab views with stale rows past L."""
    torch.manual_seed(seed)
    q = torch.randn(1, queries, heads * group, dim).to(torch.bfloat16).transpose(1, 2)
    keys, values = torch.randn(1, heads, rows + 40, dim), torch.randn(1, heads, rows + 40, dim)
    keys[:, :, rows:], values[:, :, rows:] = 50.0, -1e4
    return q, keys.to(torch.bfloat16)[:, :, :rows], values.to(torch.bfloat16)[:, :, :rows]


def reference(q, keys, values, scale):
    queries, rows = q.shape[2], keys.shape[2]
    mask = torch.ones(queries, rows, dtype=torch.bool).tril(rows - queries)  # query t sees rows <= L - T + t
    out = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)  # [1, T, H_q, D]


# (KV heads, query heads per KV head, head dim, chunk, cache rows): the default model's chunk at
# the start, mid-cache and off the block sizes (a resumed 231-token suffix), a chunk of 5, one
# token, a wide head and Gemma 3's head dim 256.
CASES = [(3, 3, 64, 256, 256), (3, 3, 64, 256, 1792), (3, 3, 64, 231, 2657), (1, 4, 128, 5, 700),
         (3, 3, 64, 1, 513), (2, 2, 256, 70, 600)]


@needs_kernel
@pytest.mark.parametrize("heads,group,dim,queries,rows", CASES)
def test_the_kernel_attends_the_cache_and_the_chunk_causally(heads, group, dim, queries, rows):
    q, keys, values = chunk(heads, group, dim, queries, rows, seed=rows + queries)
    got = torch.ops.memra.prefill_attention(q, keys, values, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (1, queries, heads * group, dim)
    expected = reference(q, keys, values, dim ** -0.5)
    sdpa = F.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5, enable_gqa=True,
                                          attn_mask=torch.ones(queries, rows, dtype=torch.bool).tril(rows - queries))
    # As close to float64 as torch's own bf16 attention is (its output rounds to bf16 too).
    assert (got.double() - expected).abs().max() <= 1.5 * (sdpa.transpose(1, 2).double() - expected).abs().max() + 1e-3


@needs_kernel
def test_the_bits_do_not_depend_on_the_thread_count():
    q, keys, values = chunk(3, 3, 64, 256, 3000, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.memra.prefill_attention(q, keys, values, 0.125)
        torch.set_num_threads(2)
        two = torch.ops.memra.prefill_attention(q, keys, values, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("change,message", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "takes bfloat16"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), "multiple of the KV heads"),
    (lambda q, k, v: (q, k[:, :, :100], v[:, :, :100]), "the chunk's own rows"),
    (lambda q, k, v: (q, k, v[:, :, :-1]), "differ in shape"),
])
def test_the_kernel_refuses_what_it_does_not_compute(change, message):
    q, keys, values = change(*chunk(3, 3, 64, 256, 1000, seed=2))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.memra.prefill_attention(q, keys, values, 0.125)


def test_an_fp32_model_keeps_torchs_attention_and_says_why(tiny_loaded):
    assert tiny_loaded.attention.value == "torch"
    assert tiny_loaded.attention.reason == "auto: the activations are float32 (the kernel multiplies bf16)"
    assert tiny_loaded.model.config._attn_implementation == "sdpa"
    assert state_format(tiny_loaded, 16, "exact")["attention"] == "torch"


def test_a_model_keeps_its_first_choice(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), device="cpu", dtype="float32", prefill_attention="torch")
    assert loaded.attention.reason == "set by engine.prefill_attention"
    assert attention.install(loaded.model, "torch") is loaded.attention
    with pytest.raises(ValueError, match="load it again"):
        attention.install(loaded.model, "auto")
    with pytest.raises(ValueError, match="auto, torch"):
        attention.install(loaded.model, "fast")


@pytest.fixture(scope="module")
def head_dim_32(tmp_path_factory):
    """A tiny llama whose heads are 32 wide (2 query heads over 1 KV head), the kernel's smallest."""
    folder = tmp_path_factory.mktemp("tiny-hd32")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_kernel
def test_a_bf16_model_on_the_kernel_matches_torchs_attention_and_resumes_bit_identically(head_dim_32):
    torch.set_num_threads(1)
    ours = load_model(str(head_dim_32), device="cpu", dtype="bfloat16")
    theirs = load_model(str(head_dim_32), device="cpu", dtype="bfloat16", prefill_attention="torch")
    assert (ours.attention.value, theirs.attention.value) == ("memra", "torch")
    assert ours.model.config._attn_implementation == attention.NAME
    assert state_format(ours, 16, "exact")["attention"] == "memra"
    ids = [(7 * i) % 90 + 3 for i in range(300)]
    cold = {}
    for loaded in (ours, theirs):
        engine = stories.make_engine(loaded, 64)
        cold[loaded.attention.value] = prefill(loaded.model, engine.new_cache(), ids, 0, 64)
        cache = engine.new_cache()
        prefill(loaded.model, cache, ids[:192], 0, 64)
        resumed = prefill(loaded.model, cache, ids[192:], 192, 64)
        assert torch.equal(resumed, cold[loaded.attention.value])
    assert not torch.equal(cold["memra"], cold["torch"])  # the kernel really ran
    assert (cold["memra"] - cold["torch"]).abs().max() < 0.05 * cold["torch"].abs().max()
