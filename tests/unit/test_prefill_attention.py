"""memra's prefill attention: what the kernel computes over a chunk and a long cache (bf16 and
fp32, on whichever path this CPU takes: AMX, AVX512-BF16, fp32 FMA; run the file again under
MEMRA_KERNEL_ISA=avx2 for the AVX2 path), that its bits depend neither on the thread count nor
on the chunk around a row, what it refuses, when a model gets it and why not, and that a model
running it still resumes bit-identically to its cold run.

The reference is float64 attention over the same rows with the causal mask transformers builds
for a chunk after a cache; the kernel is handed slab views whose rows past the end are stale.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import stories
from memrad.engine.kernels import prefill_attention
from memrad.engine.kernels.build import capability
from memrad.engine.forward import prefill
from memrad.engine.model import attention
from memrad.engine.model.hardware import Choice
from memrad.engine.model.loader import load_model
from memrad.engine.state.disk import state_format
from tiny import build_tokenizer

needs_kernel = pytest.mark.skipif(capability() not in ("AVX512", "AVX2") or prefill_attention.load() is not None,
                                  reason="the kernel runs on AVX2 or AVX512 and is built with a C++ compiler")
DTYPES = [torch.bfloat16, torch.float32]


def chunk(heads, group, dim, queries, rows, seed, dtype=torch.bfloat16):
    """q [1, H_q, T, D] as transformers hands it (a transposed view), keys and values [1, H_kv, L, D]
    as slab views with stale rows past L."""
    torch.manual_seed(seed)
    q = torch.randn(1, queries, heads * group, dim).to(dtype).transpose(1, 2)
    keys, values = torch.randn(1, heads, rows + 40, dim), torch.randn(1, heads, rows + 40, dim)
    keys[:, :, rows:], values[:, :, rows:] = 50.0, -1e4
    return q, keys.to(dtype)[:, :, :rows], values.to(dtype)[:, :, :rows]


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


# The bound on the error: as close to float64 as torch's own attention in that dtype, plus the
# output's rounding (bf16 rounds at 2^-8 of a value, fp32 sums of up to 2,657 products at ~1e-6).
SLACK = {torch.bfloat16: 1e-3, torch.float32: 2e-6}


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,group,dim,queries,rows", CASES)
def test_the_kernel_attends_the_cache_and_the_chunk_causally(heads, group, dim, queries, rows, dtype):
    q, keys, values = chunk(heads, group, dim, queries, rows, seed=rows + queries, dtype=dtype)
    got = torch.ops.memra.prefill_attention(q, keys, values, dim ** -0.5)
    assert got.dtype == dtype and got.shape == (1, queries, heads * group, dim)
    expected = reference(q, keys, values, dim ** -0.5)
    sdpa = F.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5, enable_gqa=True,
                                          attn_mask=torch.ones(queries, rows, dtype=torch.bool).tril(rows - queries))
    sdpa_error = (sdpa.transpose(1, 2).double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= 1.5 * sdpa_error + SLACK[dtype], prefill_attention.path(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bits_do_not_depend_on_the_thread_count(dtype):
    q, keys, values = chunk(3, 3, 64, 256, 3000, seed=1, dtype=dtype)
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
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_chunk_around_it(dtype):
    """On the vector paths a query row's output depends on its position and the rows it attends
    only: the same 256 queries as one chunk, as chunks of 100 + 156, and as 17 + 239 over the same
    cache give every row the same bits (AMX's products are oneDNN's: not claimed there)."""
    if prefill_attention.path(dtype) == "amx":
        pytest.skip("AMX's brgemm tiles are not claimed row-independent")
    q, keys, values = chunk(3, 3, 64, 256, 1300, seed=3, dtype=dtype)
    whole = torch.ops.memra.prefill_attention(q, keys, values, 0.125)  # [1, T, H_q, D]
    for cut in (100, 17):
        first = torch.ops.memra.prefill_attention(q[:, :, :cut], keys[:, :, :1300 - 256 + cut],
                                                  values[:, :, :1300 - 256 + cut], 0.125)
        rest = torch.ops.memra.prefill_attention(q[:, :, cut:], keys, values, 0.125)
        assert torch.equal(torch.cat([first, rest], 1), whole)


@needs_kernel
@pytest.mark.parametrize("change,message", [
    (lambda q, k, v: (q.half(), k.half(), v.half()), "takes bfloat16 or float32"),
    (lambda q, k, v: (q.float(), k, v), "one dtype"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), "multiple of the KV heads"),
    (lambda q, k, v: (q, k[:, :, :100], v[:, :, :100]), "the chunk's own rows"),
    (lambda q, k, v: (q, k, v[:, :, :-1]), "differ in shape"),
])
def test_the_kernel_refuses_what_it_does_not_compute(change, message):
    q, keys, values = change(*chunk(3, 3, 64, 256, 1000, seed=2))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.memra.prefill_attention(q, keys, values, 0.125)


def test_heads_the_kernel_cannot_tile_keep_torchs_attention_and_say_why(tiny_loaded):
    assert tiny_loaded.attention.value == "torch"
    assert tiny_loaded.attention.reason == "auto: head dim 16 is not a multiple of 32"
    assert tiny_loaded.model.config._attn_implementation == "sdpa"
    assert state_format(tiny_loaded, 16, "exact")["attention"] == "torch"


def test_a_model_keeps_its_first_choice(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), device="cpu", dtype="float32", prefill_attention="torch")
    assert loaded.attention.reason == "set by engine.prefill_attention"
    assert attention.install(loaded.model, "torch") is loaded.attention
    with pytest.raises(ValueError, match="load it again"):
        attention.install(loaded.model, "auto")
    with pytest.raises(ValueError, match="auto, memra, torch"):
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
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_on_the_kernel_matches_torchs_attention_and_resumes_bit_identically(head_dim_32, dtype):
    torch.set_num_threads(1)
    ours = load_model(str(head_dim_32), device="cpu", dtype=dtype, prefill_attention="memra")
    theirs = load_model(str(head_dim_32), device="cpu", dtype=dtype, prefill_attention="torch")
    assert (ours.attention.value, theirs.attention.value) == ("memra", "torch")
    path = prefill_attention.path(ours.model.dtype)
    assert ours.attention.reason == f"set by engine.prefill_attention: memra's prefill kernel, {attention._PATHS[path]}"
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


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_takes_the_kernel_where_it_wins_and_keeps_sdpa_where_bf16_rounding_flips_answers(head_dim_32, dtype):
    loaded = load_model(str(head_dim_32), device="cpu", dtype=dtype)
    path = prefill_attention.path(loaded.model.dtype)
    if path in attention._AUTO_DECLINES:  # AVX512-BF16 pair dots, bf16 widened on AVX2
        assert (loaded.attention.value, loaded.attention.reason) == ("torch", f"auto: {attention._AUTO_DECLINES[path]}")
        assert loaded.model.config._attn_implementation == "sdpa"
    else:  # fp32 on AVX512 / AVX2, AMX
        assert loaded.attention == Choice("memra", f"auto: memra's prefill kernel, {attention._PATHS[path]}")
    if dtype == "float32":
        assert loaded.attention.value == "memra"


def test_a_heterogeneous_config_gives_the_kernel_each_layers_head_dim():
    """Gemma 4's config has no global head_dim (reading it raises) but one a layer; a config without
    any (LFM2, Phi-3) takes hidden / heads. A layer whose head dim is not a multiple of 32 keeps SDPA."""
    class Heterogeneous:
        num_hidden_layers, hidden_size, num_attention_heads = 3, 640, 4
        per_layer_config = [SimpleNamespace(head_dim=dim) for dim in (256, 512, 256)]

        @property
        def head_dim(self):
            raise AttributeError("head_dim differs by layer: read per_layer_config")

    assert attention._head_dims(Heterogeneous()) == [256, 512, 256]
    assert attention._head_dims(SimpleNamespace(num_hidden_layers=2, hidden_size=576, num_attention_heads=9)) == [64]
    odd = Heterogeneous()
    odd.per_layer_config = [SimpleNamespace(head_dim=dim) for dim in (256, 80, 256)]
    model = SimpleNamespace(config=odd, device=torch.device("cpu"), dtype=torch.float32)
    if capability() in ("AVX512", "AVX2"):
        assert attention._why_not(model, "auto") == "head dim 80 is not a multiple of 32"
