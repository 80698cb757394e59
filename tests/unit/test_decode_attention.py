"""memra's CPU decode-attention kernel: what it computes, that its bits do not depend on the
thread count, what it refuses, and how it is built and found again.

The reference is attention in float64 over the same rows; the kernel is handed slices of a
slab whose rows past the end hold stale values that must not count.
"""

import pytest
import torch
from torch.nn import functional as F

from memrad.engine.kernels import build as kernels
from memrad.engine.kernels import decode_attention
from memrad.engine.kernels.build import cxx_compiler

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="the kernel is built with a C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert decode_attention.load(cxx_compiler()) is None


def slab(heads, rows, dim, dtype, seed):
    """q [1, H_kv, G, D] and key, value slabs [1, H_kv, rows + 16, D] with stale rows at the end."""
    torch.manual_seed(seed)
    keys, values = torch.randn(1, heads, rows + 16, dim), torch.randn(1, heads, rows + 16, dim)
    keys[:, :, rows:], values[:, :, rows:] = 50.0, -1e4
    return keys.to(dtype), values.to(dtype)


def reference(q, keys, values, scale):
    heads, group = q.shape[1], q.shape[2]
    q64 = q.double().reshape(1, heads * group, 1, -1)
    out = F.scaled_dot_product_attention(q64, keys.double(), values.double(), scale=scale, enable_gqa=True)
    return out.reshape(q.shape)


# (KV heads, query heads per KV head, head dim): the default model's, a tiny test model's, a
# wide head, and one the kernel has no vector path for (group 9, head dim 48: plain loops).
SHAPES = [(3, 3, 64), (2, 2, 16), (1, 4, 128), (2, 9, 48)]


@pytest.mark.parametrize("heads,group,dim", SHAPES)
# 544, 4160: more chunks than 256-row ones, so that heads x chunks is a multiple of 4 (balanced threads)
@pytest.mark.parametrize("rows", [1, 255, 256, 257, 544, 1000, 4160])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_the_kernel_computes_attention_over_the_first_rows_only(heads, group, dim, rows, dtype, tolerance):
    keys, values = slab(heads, rows, dim, dtype, seed=rows + dim)
    q = torch.randn(1, heads, group, dim).to(dtype)
    scale = dim ** -0.5
    got = torch.ops.memra.decode_attention(q, keys[:, :, :rows], values[:, :, :rows], scale)
    assert got.dtype == dtype and got.shape == q.shape
    expected = reference(q, keys[:, :, :rows], values[:, :, :rows], scale)
    assert (got.double() - expected).abs().max() <= tolerance


@pytest.mark.parametrize("heads,group,dim", SHAPES[:3])
@pytest.mark.parametrize("rows", [1, 257, 544, 4160])
def test_fp32_queries_over_bf16_rows_are_the_rows_widened_bit_for_bit(heads, group, dim, rows):
    """A bf16 cache under fp32 activations (memrad.engine.model.kv_dtype): the kernel widens each
    row as it reads it, so on its vector paths the output is the all-fp32 call's over the rows
    widened first, exactly (the plain loops, SHAPES[3], are compiled apart per dtype: within the
    fp32 bound there)."""
    keys, values = slab(heads, rows, dim, torch.bfloat16, seed=rows + dim)
    q = torch.randn(1, heads, group, dim)
    got = torch.ops.memra.decode_attention(q, keys[:, :, :rows], values[:, :, :rows], dim ** -0.5)
    widened = torch.ops.memra.decode_attention(q, keys[:, :, :rows].float(), values[:, :, :rows].float(), dim ** -0.5)
    assert got.dtype == torch.float32 and torch.equal(got, widened)
    lengths = [rows, 1]
    together = torch.ops.memra.decode_attention_rows(torch.cat([q, q]), [keys, keys], [values, values], lengths,
                                                      dim ** -0.5)
    assert torch.equal(together[:1], got)


def test_fp32_queries_over_bf16_rows_on_the_plain_loops_are_within_the_fp32_bound():
    keys, values = slab(2, 257, 48, torch.bfloat16, seed=5)
    q = torch.randn(1, 2, 9, 48)
    got = torch.ops.memra.decode_attention(q, keys[:, :, :257], values[:, :, :257], 48 ** -0.5)
    expected = reference(q, keys[:, :, :257].float(), values[:, :, :257].float(), 48 ** -0.5)
    assert got.dtype == torch.float32 and (got.double() - expected).abs().max() <= 2e-6


def test_the_bits_do_not_depend_on_the_thread_count():
    keys, values = slab(3, 4160, 64, torch.bfloat16, seed=1)
    q = torch.randn(1, 3, 3, 64).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        for rows in (4000, 4160, 544):  # 16 chunks; 17 raised to 20; 3 raised to 4
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(torch.ops.memra.decode_attention(q, keys[:, :, :rows], values[:, :, :rows], 0.125))
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,group,dim", SHAPES)
def test_rows_in_one_call_have_the_bits_each_row_has_alone(heads, group, dim, dtype):
    """The batched step's call: row r over its own slab and length, the one-row op's bits for it at
    any neighbours, any thread count; rows sharing a slab (a verify run) included."""
    lengths = [1, 257, 40, 41, 1000, 3]
    slabs = [slab(heads, n, dim, dtype, seed=n + r) for r, n in enumerate(lengths)]
    slabs[3] = slabs[2]  # rows 2 and 3: one run on one slab, at consecutive lengths
    q = torch.randn(len(lengths), heads, group, dim).to(dtype)
    alone = [torch.ops.memra.decode_attention(q[r : r + 1], k[:, :, :n], v[:, :, :n], dim ** -0.5)
             for r, ((k, v), n) in enumerate(zip(slabs, lengths))]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = torch.ops.memra.decode_attention_rows(  # whole slabs: the rows past a length are stale
                q, [k for k, _ in slabs], [v for _, v in slabs], lengths, dim ** -0.5)
            assert together.shape == q.shape and together.dtype == dtype
            assert all(torch.equal(together[r : r + 1], alone[r]) for r in range(len(lengths)))
    finally:
        torch.set_num_threads(before)


def test_rows_refuse_counts_and_lengths_the_keys_do_not_have():
    keys, values = slab(3, 8, 64, torch.bfloat16, seed=3)
    q = torch.randn(2, 3, 3, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="takes q \\[B, H_kv, G, D\\] and B keys, values and lengths"):
        torch.ops.memra.decode_attention_rows(q, [keys], [values], [8], 0.125)
    with pytest.raises(RuntimeError, match="a length past its keys' rows"):
        torch.ops.memra.decode_attention_rows(q, [keys, keys], [values, values], [8, 25], 0.125)
    with pytest.raises(RuntimeError, match="no rows to attend"):
        torch.ops.memra.decode_attention_rows(q, [keys, keys], [values, values], [8, 0], 0.125)


def test_mismatched_inputs_are_refused_with_what_is_wrong():
    keys, values = slab(3, 8, 64, torch.bfloat16, seed=2)
    with pytest.raises(RuntimeError, match="keys and values differ in dtype"):
        torch.ops.memra.decode_attention(torch.randn(1, 3, 3, 64), keys, values.float(), 0.125)
    with pytest.raises(RuntimeError, match="decode_attention takes bfloat16 or float32"):
        torch.ops.memra.decode_attention(torch.randn(1, 3, 3, 64).half(), keys, values, 0.125)
    with pytest.raises(RuntimeError, match="q does not match the keys' heads"):
        torch.ops.memra.decode_attention(torch.randn(1, 2, 3, 64).to(torch.bfloat16), keys, values, 0.125)
    with pytest.raises(RuntimeError, match="no rows to attend"):
        torch.ops.memra.decode_attention(torch.randn(1, 3, 3, 64).to(torch.bfloat16), keys[:, :, :0],
                                         values[:, :, :0], 0.125)


def test_the_build_is_found_again_and_named_by_what_went_into_it(monkeypatch):
    compiler = cxx_compiler()
    path = kernels.library_path(compiler, decode_attention.SOURCE)
    assert path.exists() and path.name.startswith(f"decode_attention-{kernels.capability().lower()}-")
    assert kernels.build(compiler, decode_attention.SOURCE) == path  # cached: no second build
    assert decode_attention.load(compiler, build_missing=False) is None
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert kernels.library_path(compiler, decode_attention.SOURCE) != path  # another torch builds afresh


def test_without_a_compiler_the_reason_says_what_to_install():
    assert decode_attention.load(None) == "no C++ compiler to build the attention kernel (install g++)"
