"""memra's block kernel: a GGUF's Q8_0 / Q5_0 / Q4_1 / MXFP4 blocks and Q4_K / Q5_K / Q6_K super-blocks,
as shipped, multiplied for one token (and for a few rows at once, each row as it is alone)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from memrad.engine.kernels import block_gemv
from memrad.engine.kernels.build import cxx_compiler
from memrad.engine.model import block_linear
from memrad.engine.model.block_linear import MXFP4, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, BlockLinear
from memrad.engine.model.quant import (
    Int4Blocks, Int8Blocks, SuperBlocks, random_super_blocks, unpack_blocks, unpack_q5_0, unpack_q8_0,
)

pytestmark = pytest.mark.skipif(block_gemv.why_not() is not None, reason=str(block_gemv.why_not()))

_TYPES = {"Q8_0": (GGMLQuantizationType.Q8_0, unpack_q8_0, Q8_0),
          "Q5_0": (GGMLQuantizationType.Q5_0, unpack_q5_0, Q5_0),
          "Q4_1": (GGMLQuantizationType.Q4_1, lambda raw: unpack_blocks(raw, "Q4_1"), Q4_1),
          "MXFP4": (GGMLQuantizationType.MXFP4, lambda raw: SuperBlocks("MXFP4", torch.from_numpy(raw)), MXFP4),
          "Q4_K": (GGMLQuantizationType.Q4_K, None, Q4_K), "Q5_K": (GGMLQuantizationType.Q5_K, None, Q5_K),
          "Q6_K": (GGMLQuantizationType.Q6_K, None, Q6_K)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


# the AVX512 and AVX2 builds' layouts ("Q5_0 x16": Q5_0's codes as Q8_0 x16 blocks)
INTERLEAVED = ("Q8_0 x16", "Q4_1 x16", "Q5_0 x16") if block_gemv.interleaves() else ()


def _packed(kind: str, blocks) -> tuple[int, torch.Tensor]:
    """The op's kind and bytes for `kind` ("Q4_1 x16": Q4_1's blocks, 16 rows interleaved)."""
    op_kind, packed = block_linear.pack(blocks, widen=kind.endswith(" x16"))
    return block_linear.interleave(op_kind, packed) if kind.endswith(" x16") else (op_kind, packed)


def _shipped(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, Int8Blocks | Int4Blocks | SuperBlocks]:
    kind = kind.removesuffix(" x16")
    if kind in K_QUANTS:  # gguf-py cannot write k-quants: random super-blocks, read back by gguf-py's dequantize
        blocks = random_super_blocks(kind, rows, cols, torch.Generator().manual_seed(seed))
        return blocks.raw.numpy(), blocks
    gguf_type, unpack, _ = _TYPES[kind]
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quants.quantize(weights, gguf_type)  # [rows, cols/32 * block bytes], as llama.cpp writes it
    return raw, unpack(raw)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_1", "MXFP4", *K_QUANTS])
def test_packed_blocks_are_the_gguf_bytes_llama_cpp_ships_byte_for_byte(kind):
    raw, blocks = _shipped(kind, 40, 256, seed=1)
    op_kind, packed = block_linear.pack(blocks)
    assert op_kind == _TYPES[kind][2]
    assert torch.equal(packed, torch.from_numpy(np.ascontiguousarray(raw)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_1", "MXFP4", *K_QUANTS, *INTERLEAVED])
def test_the_kernel_multiplies_the_shipped_weights_within_the_int16_rounding_of_the_activation(kind):
    n = 80 if kind in INTERLEAVED else 70  # the interleaved kinds: rows in sixteens
    _, blocks = _shipped(kind, n, 768, seed=2)  # 768: 3 super-blocks, 24 blocks of 32
    op_kind, packed = _packed(kind, blocks)
    x = torch.randn(3, 768)
    x[0, :32] *= 50  # an outlier block: its small entries lose the most to the rounding
    got = torch.ops.memra.block_gemv(x, packed, op_kind)  # [3, N]
    w = blocks.dequantize().double()  # the shipped weights, exactly (the k-quants: as gguf-py reads them)
    expected = x.double() @ w.t()
    assert got.dtype == torch.float32 and got.shape == (3, n)
    # x is rounded to int16 per block of 32: each entry moves by at most 2^-16 of its block's max
    step = x.double().view(3, 24, 32).abs().amax(-1) / 65534  # [M, blocks]
    bound = step @ w.abs().view(n, 24, 32).sum(-1).t()  # [M, N]
    error = (got.double() - expected).abs()
    assert bool((error <= 1.01 * bound + 1e-6 * expected.abs().max()).all())
    assert float(error.max()) < 1e-4 * float(expected.abs().max())
    bf16 = torch.ops.memra.block_gemv(x.bfloat16(), packed, op_kind)
    assert bf16.dtype == torch.bfloat16  # the sums are float32; only the output is rounded
    assert torch.equal(bf16, torch.ops.memra.block_gemv(x.bfloat16().float(), packed, op_kind).bfloat16())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "MXFP4", *K_QUANTS, *INTERLEAVED])
def test_each_output_has_the_same_bits_alone_batched_and_on_any_thread_count(kind):
    # 301: tiles of 64 and rows of 4 (pairs of 2) leave remainders; 304: 19 groups of 16, the last tile's 3
    _, blocks = _shipped(kind, 304 if kind in INTERLEAVED else 301, 256, seed=3)
    op_kind, packed = _packed(kind, blocks)
    x = torch.randn(8, 256).bfloat16()
    others = torch.randn(8, 256).bfloat16() * 30  # different neighbours, other magnitudes
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([torch.ops.memra.block_gemv(x[i:i + 1], packed, op_kind) for i in range(8)])
        torch.set_num_threads(2)
        for m in range(2, 9):  # 5: one full group of 4 activation rows and a lone one; 8: the x16 kinds' group
            for i in range(8):
                batch = torch.cat([others[:m - 1], others[:0]])
                batch = torch.cat([batch[:i % m], x[i:i + 1], batch[i % m:]])  # row i at position i % m
                got = torch.ops.memra.block_gemv(batch, packed, op_kind)[i % m]
                assert torch.equal(got, alone[i]), (m, i)
        assert torch.equal(torch.ops.memra.block_gemv(x, packed, op_kind), alone)
    finally:
        torch.set_num_threads(threads)


def test_q4_0_blocks_run_as_q4_1_exactly_and_q4_k_blocks_are_not_packed():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scales = (torch.rand(8, 2) / 50).half().float()
    q4_0 = Int4Blocks(codes, scales, None)  # w = (q − 8)·d: m = −8·d, exact in fp16
    assert block_linear.packable(q4_0)
    kind, packed = block_linear.pack(q4_0)
    assert kind == Q4_1 and packed.shape == (8, 2 * 20)
    x = torch.randn(2, 64)
    expected = x.double() @ q4_0.dequantize().double().t()
    assert torch.allclose(torch.ops.memra.block_gemv(x, packed, kind).double(), expected, rtol=0, atol=1e-4)
    d = torch.tensor(1 + 2.0 ** -10)  # an fp16 d; Q4_K's sub-block scale d·sc with sc = 37 needs 16 bits
    q4_k = Int4Blocks(codes, (d * 37).expand(8, 2).clone(), torch.zeros(8, 2))
    assert not block_linear.packable(q4_k)


def test_a_block_linear_runs_its_blocks_for_one_token_and_the_dense_weight_for_more():
    _, blocks = _shipped("Q5_0", 64, 96, seed=4)
    linear = torch.nn.Linear(96, 64, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    layer = BlockLinear.from_blocks(linear, blocks)
    assert layer.format == "Q5_0" and layer.blocks.shape == (64, 3 * 22)
    one = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(one), torch.ops.memra.block_gemv(one.view(1, 96), layer.blocks, Q5_0).view(1, 1, 64))
    many = torch.randn(1, 5, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(many), torch.nn.functional.linear(many, linear.weight))


def test_codes_past_5_bits_or_scales_that_are_not_fp16_are_not_packed_as_q5_0():
    codes = torch.full((2, 32), -16, dtype=torch.int8)
    codes[0, 0] = 16  # one code past Q5_0's range: Q8_0 blocks
    assert block_linear.pack(Int8Blocks(codes, torch.ones(2, 1)))[0] == Q8_0
    assert not block_linear.packable(Int8Blocks(codes, torch.full((2, 1), 1 + 2.0 ** -20)))


def test_fused_block_projections_share_the_rows_and_compute_what_each_computes():
    from memrad.engine.decode.steps.llama import fuse

    layers = []
    for rows, seed in ((128, 5), (48, 6)):
        _, blocks = _shipped("Q5_0", rows, 96, seed)
        linear = torch.nn.Linear(96, rows, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(blocks.dequantize())
        layers.append(BlockLinear.from_blocks(linear, blocks))
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    separate = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = fuse(layers)
    assert isinstance(fused, BlockLinear) and layers[1].blocks.data_ptr() == fused.blocks[128:].data_ptr()
    assert torch.equal(fused(x), separate)
    _, q8 = _shipped("Q8_0", 16, 96, seed=7)
    mixed = fuse([layers[0], BlockLinear.from_blocks(torch.nn.Linear(96, 16, bias=False), q8)])
    assert not isinstance(mixed, BlockLinear)  # Q5_0 beside Q8_0: run one by one



_FORCED = """
import sys
import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from memrad.engine.kernels import block_gemv, build
from memrad.engine.model import block_linear
from memrad.engine.model.quant import SuperBlocks, random_super_blocks, unpack_blocks, unpack_q5_0, unpack_q8_0

if block_gemv.capability() == "DEFAULT":  # not chosen by memrad: loaded as is
    torch.ops.load_library(str(build.build(build.cxx_compiler(), block_gemv.SOURCE)))
else:
    assert block_gemv.why_not() is None, block_gemv.why_not()
print("path", block_gemv.path().replace(" ", "_"))
unpack = {"Q8_0": unpack_q8_0, "Q5_0": unpack_q5_0, "Q4_0": lambda raw: unpack_blocks(raw, "Q4_0"),
          "Q4_1": lambda raw: unpack_blocks(raw, "Q4_1"), "MXFP4": lambda raw: SuperBlocks("MXFP4", torch.from_numpy(raw))}
# the interleaved kinds (rows in sixteens): 304 rows (a tile's remainder), then the default model's
# shapes: its Q4_1 layers' and its Q8_0 head's K with 2064 of its rows (the last tile one group)
cases = [(kind, 301, 640) for kind in unpack] + [(kind, 301, 512) for kind in ("Q4_K", "Q5_K", "Q6_K")]
if block_gemv.interleaves():
    cases += [("Q8_0_x16", 304, 640), ("Q4_1_x16", 304, 640), ("Q4_0_x16", 304, 640), ("Q8_0_x16", 2064, 576),
              *(("Q4_1_x16", n, k) for n, k in ((192, 576), (576, 576), (1536, 576), (576, 1536)))]
outputs = {}
for seed, (kind, n, k) in enumerate(cases):
    g = torch.Generator().manual_seed(seed)
    plain = kind.removesuffix("_x16")
    if plain in unpack:
        weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        blocks = unpack[plain](quants.quantize(weights, getattr(GGMLQuantizationType, plain)))
    else:  # the k-quants: random super-blocks, K = 512 (two a row)
        blocks = random_super_blocks(kind, n, k, g)
    op_kind, raw = block_linear.pack(blocks)
    if kind.endswith("_x16"):
        op_kind, raw = block_linear.interleave(op_kind, raw)
        assert op_kind in (block_linear.Q4_1_X16, block_linear.Q8_0_X16), op_kind
        kind = f"{kind}_{n}x{k}"
    k = blocks.shape[1]
    x = torch.randn(8, k, generator=g)
    x[0, :32] *= 50  # an outlier block: its small entries lose the most to the rounding
    others = torch.randn(8, k, generator=g) * 30  # other neighbours, other magnitudes
    w = blocks.dequantize().double()  # the shipped weights, exactly
    expected = x.double() @ w.t()
    torch.set_num_threads(1)
    alone = torch.cat([torch.ops.memra.block_gemv(x[i:i + 1], raw, op_kind) for i in range(8)])  # [8, 301]
    bound = block_gemv.rounding_bound(x, w, block_gemv.activation_step(block_gemv.path()))
    error = (alone.double() - expected).abs()
    print("bound", kind, float((error / (1.01 * bound + 1e-6 * expected.abs().max())).max()))
    torch.set_num_threads(2)
    same = all(torch.equal(torch.ops.memra.block_gemv(torch.cat([others[:i % m], x[i:i + 1], others[i % m:m - 1]]),
                                                      raw, op_kind)[i % m], alone[i])
               for m in range(2, 9) for i in range(8))  # row i at position i % m among m rows (M = 1..8)
    same = same and torch.equal(torch.ops.memra.block_gemv(x, raw, op_kind), alone)
    bf16 = torch.ops.memra.block_gemv(x.bfloat16(), raw, op_kind)
    same = same and bf16.dtype == torch.bfloat16 and torch.equal(
        bf16, torch.ops.memra.block_gemv(x.bfloat16().float(), raw, op_kind).bfloat16())
    print("same", kind, same)
    outputs[kind] = {"alone": alone, "x": x, "raw": raw, "op_kind": op_kind}
torch.save(outputs, sys.argv[1])
"""


def _forced(tmp_path, **env):
    """Run _FORCED in a child under `env` (the kernel's ISA forced); its report and its outputs."""
    import os
    import subprocess
    import sys

    out = tmp_path / f"out-{'-'.join(env.values())}.pt"
    child = subprocess.run([sys.executable, "-c", _FORCED, str(out)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, child.stderr[-2000:]
    report = [line.split() for line in child.stdout.splitlines()]
    return {(words[0], words[1]): words[-1] for words in report}, torch.load(out)


X16_CASES = ("Q8_0_x16_304x640", "Q4_1_x16_304x640", "Q4_0_x16_304x640", "Q8_0_x16_2064x576", "Q4_1_x16_192x576",
             "Q4_1_x16_576x576", "Q4_1_x16_1536x576", "Q4_1_x16_576x1536")  # the default model's shapes among them


@pytest.mark.skipif(cxx_compiler() is None, reason="needs a C++ compiler")
def test_the_forced_avx2_path_holds_its_int16_bound_and_gives_a_row_the_same_bits_alone_batched_and_on_2_threads(
        tmp_path):
    """The path AVX2-only CPUs take (int16 activations, two madds a block), built here with
    MEMRA_KERNEL_ISA=avx2 on any x86 machine: with AVX-VNNI where the CPU has it and without; every
    kind, the k-quants' super-blocks among them."""
    report, outputs = _forced(tmp_path, MEMRA_KERNEL_ISA="avx2")
    plain_report, plain_outputs = _forced(tmp_path, MEMRA_KERNEL_ISA="avx2", MEMRA_KERNEL_VNNI="0")
    assert plain_report[("path", "avx2_int16")] == "avx2_int16"
    assert report.get(("path", "avx2_int16_avx-vnni"), report.get(("path", "avx2_int16"))) is not None
    for kind in ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q5_K", "Q6_K", *X16_CASES):
        for got in (report, plain_report):
            assert float(got[("bound", kind)]) <= 1.0, (kind, got)  # within the int16 rounding of x
            assert got[("same", kind)] == "True", kind  # M = 1..8, any position, 1 and 2 threads
        assert torch.equal(outputs[kind]["alone"], plain_outputs[kind]["alone"])  # vpdpwssd, madd + add: the same integers
    if block_gemv.capability() == "AVX512" and block_gemv.interleaves():
        # the interleaved kinds at 8 lanes run each output's operations as the 16 lanes do: the same bits
        for kind in X16_CASES:
            case = outputs[kind]
            assert torch.equal(torch.ops.memra.block_gemv(case["x"], case["raw"], case["op_kind"]), case["alone"]), kind


@pytest.mark.skipif(cxx_compiler() is None, reason="needs a C++ compiler")
def test_the_kernels_plain_cpp_path_multiplies_every_kind_like_float64(tmp_path):
    """The path a CPU without AVX2 builds (memrad does not choose it, but it must be right)."""
    report, _ = _forced(tmp_path, MEMRA_KERNEL_ISA="default")
    assert report[("path", "plain_float32")] == "plain_float32"
    assert not any("_x16" in kind for _, kind in report)  # the interleaved kinds: AVX512 and AVX2 only
    assert all(float(report[("bound", kind)]) <= 1.0 for kind in ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q5_K",
                                                                        "Q6_K"))
    assert all(report[("same", kind)] == "True" for kind in ("MXFP4", "Q4_K", "Q5_K", "Q6_K"))


@pytest.mark.skipif(not INTERLEAVED, reason="the interleaved kinds run on the AVX512 build only")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_interleaved_blocks_hold_every_row_s_own_blocks_and_a_cut_at_sixteen_rows_is_the_part_s_own(kind):
    _, blocks = _shipped(kind, 48, 96, seed=7)
    plain_kind, plain = block_linear.pack(blocks)
    op_kind, packed = block_linear.interleave(plain_kind, plain)
    assert op_kind == {"Q8_0": block_linear.Q8_0_X16, "Q4_1": block_linear.Q4_1_X16}[kind]
    assert packed.shape == plain.shape and not torch.equal(packed, plain)
    x = torch.randn(5, 96)
    whole = torch.ops.memra.block_gemv(x, packed, op_kind)
    assert torch.equal(torch.ops.memra.block_gemv(x, packed[16:48], op_kind), whole[:, 16:])  # a fused part
    expected = x.double() @ blocks.dequantize().double().t()
    assert float((whole.double() - expected).abs().max()) < 1e-4 * float(expected.abs().max())
    kept_kind, kept = block_linear.interleave(plain_kind, plain[:40])  # rows not in sixteens: as they are
    assert kept_kind == plain_kind and torch.equal(kept, plain[:40])
    assert block_linear.interleave(block_linear.Q5_0, plain)[0] == block_linear.Q5_0
    linear = torch.nn.Linear(96, 48, bias=False)
    assert BlockLinear.from_blocks(linear, blocks, interleaved=True).format == kind


@pytest.mark.skipif(not INTERLEAVED, reason="the interleaved kinds run on the AVX512 and AVX2 builds only")
def test_q5_0_blocks_interleave_as_q8_0_blocks_of_the_same_weights():
    # a Q5_0 code q - 16 is an int8: laid out 16 rows side by side, its blocks are Q8_0 x16 blocks
    # (34 bytes where 22 are shipped) of exactly the shipped weights, with no bits to unpack
    raw, blocks = _shipped("Q5_0", 48, 96, seed=8)
    assert block_linear.pack(blocks)[0] == Q5_0 and block_linear.interleaved_kind(blocks) == block_linear.Q8_0_X16
    kind, widened = block_linear.pack(blocks, widen=True)
    assert kind == Q8_0 and widened.shape == (48, 3 * 34)
    shipped = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q5_0))  # as gguf-py reads them
    assert torch.equal(unpack_q8_0(widened.numpy()).dequantize(), shipped)
    layer = BlockLinear.from_blocks(torch.nn.Linear(96, 48, bias=False), blocks, interleaved=True)
    assert layer.kind == block_linear.Q8_0_X16 and layer.format == "Q8_0"
    assert torch.equal(layer.blocks, block_linear.interleave(Q8_0, widened)[1])
    x = torch.randn(3, 1, 96)
    expected = x.view(3, -1).double() @ shipped.double().t()
    bound = block_gemv.rounding_bound(x.view(3, -1), shipped.double(), block_gemv.activation_step(block_gemv.path()))
    assert bool(((layer(x).view(3, -1).double() - expected).abs() <= bound + 1e-6).all())
