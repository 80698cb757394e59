"""Which kernel runs a GGUF's blocks for one token: memra's block kernel or torch's int4, by CPU and measurement."""

import json

import pytest
import torch

from memrad.engine.kernels import block_gemv
from memrad.engine.model import block_linear, kernel_choice
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.kernel_choice import Verdict, decide
from memrad.engine.model.loader import load_model
from memrad.engine.model.quant import Int4Blocks, Int4Linear, Int8Blocks, Q8Linear, random_super_blocks

pytestmark = pytest.mark.skipif(block_gemv.why_not() is not None, reason=str(block_gemv.why_not()))


def _timer(block_s: float, int4_s: float, x16_s: float | None = None):
    """A fake clock: (row-major blocks, torch's int4 kernel[, interleaved blocks]) seconds a call, for every shape."""
    return lambda *calls: ([call() for call in calls], (block_s, int4_s, x16_s)[:len(calls)])[-1]


def _groups():  # [64, 128] blocks: 4 of 32 a row
    g = torch.Generator().manual_seed(0)
    scales = (torch.rand(64, 4, generator=g) / 50).half().float()
    head = Int8Blocks(torch.randint(-127, 128, (64, 128), generator=g).to(torch.int8), scales)
    layer = Int4Blocks(torch.randint(0, 16, (64, 128), generator=g).to(torch.uint8), scales, -8 * scales)
    return {"head Q8_0": {"lm_head": head}, "layers Q4_0": {"a.0": layer, "a.1": layer}}


def test_the_verdict_names_the_winner_its_path_and_the_measured_ratio():
    assert decide("head Q8_0", 0.010, 0.019, "avx2 int16 avx-vnni", "torch int4 hi|lo") == Verdict(
        "head Q8_0", True, "memra block kernel, avx2 int16 avx-vnni, 1.9x torch int4 hi|lo (measured at load, one row)")
    assert decide("layers Q4_1", 0.012, 0.010, "avx2 int16", "torch int4") == Verdict(
        "layers Q4_1", False, "torch int4, 1.2x memra block kernel (avx2 int16; measured at load, one row)")
    # three kernels where the group's blocks interleave: the fastest, and what the others cost
    assert decide("layers Q4_1", 0.012, 0.018, "avx2 int16", "torch int4", x16_s=0.006) == Verdict(
        "layers Q4_1", True, "memra block kernel, avx2 int16, 16 rows interleaved, 3.0x torch int4, 2.0x row-major "
                             "blocks (measured at load, one row)", interleaved=True)
    assert decide("head Q8_0", 0.010, 0.019, "avx2 int16", "torch int4 hi|lo", x16_s=0.015) == Verdict(
        "head Q8_0", True, "memra block kernel, avx2 int16, 1.9x torch int4 hi|lo, 1.5x interleaved "
                           "(measured at load, one row)")
    assert decide("layers Q4_1", 0.020, 0.010, "avx2 int16", "torch int4", x16_s=0.012) == Verdict(
        "layers Q4_1", False, "torch int4, 1.2x memra block kernel (avx2 int16; measured at load, one row)")
    assert decide("layers Q4_1", 0.010, 0.010, "avx2 int16", "torch int4", x16_s=0.010).interleaved  # ties: interleaved


@pytest.mark.parametrize("interleaves", [True, False])
def test_on_avx512_the_head_runs_the_blocks_and_the_4_bit_layers_interleaved_as_measured_offline(monkeypatch,
                                                                                                  interleaves):
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX512")
    monkeypatch.setattr(block_gemv, "interleaves", lambda: interleaves)

    def never(*_fns):
        raise AssertionError("measured on AVX512")

    groups = _groups()
    g = torch.Generator().manual_seed(1)
    odd = Int4Blocks(torch.randint(0, 16, (40, 128), generator=g).to(torch.uint8), torch.ones(40, 4), -8 * torch.ones(40, 4))
    q8 = Int8Blocks(torch.randint(-127, 128, (64, 128), generator=g).to(torch.int8), torch.ones(64, 4))
    groups.update({"layers Q4_1": {"b.0": odd}, "layers Q8_0": {"c.0": q8}})
    verdicts = kernel_choice.choose(groups, {}, torch.float32, timer=never)
    # the head's 64 rows, interleaved where the build interleaves (BlockLinear.from_blocks lays them out so)
    layout = ", 16 rows interleaved" if interleaves else ""
    why = f"memra block kernel, {block_gemv.path()}{layout}; measured once: docs/BENCHMARKS.md#memras-block-kernel"
    assert verdicts["head Q8_0"] == Verdict("head Q8_0", True, why, interleaves)
    # 4-bit layers in sixteens run interleaved where the build interleaves; rows not in sixteens
    # and the 8-bit layers stay on torch's int4 kernel, as measured offline
    assert verdicts["layers Q4_0"] == Verdict("layers Q4_0", interleaves, why if interleaves else "", interleaves)
    assert not verdicts["layers Q4_1"].blocks and not verdicts["layers Q8_0"].blocks
    # a head not in sixteens runs its plain blocks, and says so
    odd_head = Int8Blocks(torch.randint(-127, 128, (40, 128), generator=g).to(torch.int8), torch.ones(40, 4))
    plain = kernel_choice.choose({"head Q8_0": {"lm_head": odd_head}}, {}, torch.float32, timer=never)["head Q8_0"]
    assert plain == Verdict("head Q8_0", True, f"memra block kernel, {block_gemv.path()}; "
                                               "measured once: docs/BENCHMARKS.md#memras-block-kernel")


def test_on_avx2_each_group_is_measured_once_and_the_verdict_kept_for_later_starts(monkeypatch, tmp_path):
    """Both groups' blocks interleave (64 rows): row-major, torch's int4 and interleaved, timed."""
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX2")
    cache = tmp_path / "choices.json"
    path = block_gemv.path()
    verdicts = kernel_choice.choose(_groups(), {}, torch.float32, cache=cache, timer=_timer(1e-4, 3e-4, 2e-4))
    assert verdicts["head Q8_0"] == Verdict("head Q8_0", True, f"memra block kernel, {path}, 3.0x torch int4 hi|lo, "
                                                               "2.0x interleaved (measured at load, one row)")
    assert verdicts["layers Q4_0"].blocks and "3.0x torch int4, 2.0x interleaved (" in verdicts["layers Q4_0"].reason
    kept = json.loads(cache.read_text())
    # the layers' two members share a shape: one timed, counted twice (the kept times are the sums)
    by_group = {group: value for key, value in kept.items() for group in ("head Q8_0", "layers Q4_0") if group in key}
    assert by_group == {"head Q8_0": {"block_s": 1e-4, "int4_s": 3e-4, "x16_s": 2e-4},
                        "layers Q4_0": {"block_s": 2e-4, "int4_s": 6e-4, "x16_s": 4e-4}}
    assert all(block_gemv.library().name in key and f"threads {torch.get_num_threads()}" in key for key in kept) and len(kept) == 2

    def never(*_fns):
        raise AssertionError("measured again")

    assert kernel_choice.choose(_groups(), {}, torch.float32, cache=cache, timer=never) == verdicts
    slower = kernel_choice.choose(_groups(), {}, torch.bfloat16, cache=cache, timer=_timer(4e-4, 2e-4, 5e-4))
    assert not slower["head Q8_0"].blocks  # another dtype: measured afresh
    assert slower["head Q8_0"].reason == f"torch int4 hi|lo, 2.0x memra block kernel ({path}; measured at load, one row)"


def test_a_group_of_one_shape_is_timed_on_one_layer_and_counted_for_each(monkeypatch, tmp_path):
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX2")
    calls = []
    verdicts = kernel_choice.choose({"layers Q4_0": _groups()["layers Q4_0"]}, {}, torch.float32,
                                    cache=tmp_path / "c.json", timer=lambda *fns: calls.append(fns) or (1e-4,) * len(fns))
    kept, = json.loads((tmp_path / "c.json").read_text()).values()
    assert len(calls) == 1 and len(calls[0]) == 3 and kept == {"block_s": 2e-4, "int4_s": 2e-4, "x16_s": 2e-4}
    assert verdicts["layers Q4_0"].interleaved  # a tie goes to the block kernel, interleaved


@pytest.mark.skipif(not block_gemv.interleaves(), reason="the interleaved kinds run on the AVX512 and AVX2 builds only")
def test_on_avx2_q5_0_layers_are_also_timed_as_q8_0_x16_and_a_verdict_kept_without_that_arm_is_measured_again(
        monkeypatch, tmp_path):
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX2")
    g = torch.Generator().manual_seed(2)
    q5 = Int8Blocks(torch.randint(-16, 16, (64, 128), generator=g).to(torch.int8), (torch.rand(64, 4, generator=g) / 50).half().float())
    assert block_linear.kind_of(q5) == block_linear.Q5_0
    group = {"layers Q5_0": {"d.0": q5}}
    cache = tmp_path / "c.json"
    key = (f"{block_gemv.library().name} layers Q5_0 [(((64, 128), 'Int8Blocks'), 1)] torch.float32 "
           f"threads {torch.get_num_threads()}")
    cache.write_text(json.dumps({key: {"block_s": 1e-4, "int4_s": 3e-4}}))  # kept before Q5_0 had its x16 arm
    calls = []
    verdict = kernel_choice.choose(group, {}, torch.float32, cache=cache,
                                   timer=lambda *fns: calls.append(fns) or (2e-4, 3e-4, 1e-4)[:len(fns)])["layers Q5_0"]
    assert len(calls) == 1 and len(calls[0]) == 3
    assert verdict == Verdict("layers Q5_0", True, f"memra block kernel, {block_gemv.path()}, 16 rows interleaved as "
                                                   "Q8_0 (34 B a block, 22 shipped), 3.0x torch int4 hi|lo, 2.0x "
                                                   "row-major blocks (measured at load, one row)", interleaved=True)
    assert json.loads(cache.read_text())[key] == {"block_s": 2e-4, "int4_s": 3e-4, "x16_s": 1e-4}


def _load(folder):
    torch.set_num_threads(1)
    return load_model(str(folder), device="cpu", dtype="float32", weights="auto")


def _by_kernel(times: dict):
    """A fake clock that times a call by the layer it ran: {(class name, block format or None): seconds},
    the format "Q4_1 x16" for interleaved blocks."""
    def name(module) -> tuple[str, str | None]:
        layout = " x16" if getattr(module, "interleaved", False) else ""
        return type(module).__name__, getattr(module, "format", None) and module.format + layout

    def one(fn):
        ran = []
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: ran.append(name(module)))
        try:
            fn()
        finally:
            handle.remove()
        return times[ran[0]]
    return lambda *calls: tuple(one(call) for call in calls)


def test_on_avx2_the_layers_run_the_blocks_where_they_won_interleaved_or_not_and_status_says_why(
        q4_dir, monkeypatch, tmp_path):
    """The AVX2 build interleaves: the Q4_1 layers win interleaved, the Q8_0 head row-major."""
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))  # a fresh verdicts file
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX2")
    monkeypatch.setattr(kernel_choice, "_fastest", _by_kernel({
        ("BlockLinear", "Q4_1 x16"): 1e-4, ("BlockLinear", "Q4_1"): 2e-4, ("Int4Linear", None): 3e-4,
        ("BlockLinear", "Q8_0 x16"): 3e-4, ("BlockLinear", "Q8_0"): 1e-4, ("Q8Linear", None): 2e-4}))
    loaded = _load(q4_dir)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 15 and {(m.format, m.interleaved) for m in layers} == {("Q4_1", True), ("Q8_0", False)}
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    path = block_gemv.path()
    assert (f"self_attn.q_proj GGUF x2: Q4_1 x16 blocks (memra block kernel, {path}, 16 rows interleaved, 3.0x torch "
            "int4, 2.0x row-major blocks (measured at load, one row))") in loaded.tensors.reason
    assert (f"lm_head GGUF x1: Q8_0 blocks (memra block kernel, {path}, 2.0x torch int4 hi|lo, 3.0x interleaved "
            "(measured at load, one row))") in loaded.tensors.reason
    assert loaded.tensors.value == "Q8_0 blocks 1, Q4_1 x16 blocks 14" and loaded.head == "q8_0 blocks"
    x = torch.randn(1, 1, 64)
    q = model.model.layers[0].self_attn.q_proj
    assert q.kind == block_linear.Q4_1_X16
    assert torch.equal(q(x), torch.ops.memra.block_gemv(x.view(1, 64), q.blocks, q.kind).view(1, 1, -1))


def test_on_avx2_where_the_int4_kernel_wins_the_layers_they_pack_for_it_and_the_head_keeps_its_blocks(
        q4_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX2")
    monkeypatch.setattr(kernel_choice, "_fastest", _by_kernel({
        ("BlockLinear", "Q8_0"): 1e-4, ("BlockLinear", "Q8_0 x16"): 0.5e-4, ("Q8Linear", None): 4e-4,
        ("BlockLinear", "Q4_1"): 3e-4, ("BlockLinear", "Q4_1 x16"): 2.4e-4, ("Int4Linear", None): 2e-4}))
    loaded = _load(q4_dir)
    assert type(loaded.model.lm_head) is BlockLinear and loaded.head == "q8_0 blocks" and loaded.model.lm_head.interleaved
    assert sum(type(m) is Int4Linear for m in loaded.model.modules()) == 14
    path = block_gemv.path()
    # the int4 kernel's lead over the faster of memra's two layouts (interleaved, 2.4e-4)
    assert ("self_attn.q_proj GGUF x2: int4 (torch int4, 1.2x memra block kernel "
            f"({path}; measured at load, one row))") in loaded.tensors.reason
    assert (f"lm_head GGUF x1: Q8_0 x16 blocks (memra block kernel, {path}, 16 rows interleaved, 8.0x torch int4 hi|lo, "
            "2.0x row-major blocks") in loaded.tensors.reason
    assert not any(isinstance(m, Q8Linear) for m in loaded.model.modules())


def test_the_k_quants_super_blocks_are_measured_here_on_avx512_too_against_int4_or_the_dense_weight(
        monkeypatch, tmp_path):
    """No offline measurement covers them: Q4_K against torch's int4 kernel (its unpacked blocks),
    Q5_K / Q6_K against the dense weight (torch's int4 kernel cannot run them); the others as before."""
    monkeypatch.setattr(block_gemv, "capability", lambda: "AVX512")
    g = torch.Generator().manual_seed(1)
    groups = {"layers Q4_K": {"a.0": random_super_blocks("Q4_K", 64, 256, g)},
              "layers Q6_K": {"b.0": random_super_blocks("Q6_K", 64, 256, g)},
              "layers Q5_K": {"c.0": random_super_blocks("Q5_K", 48, 512, g)}, **_groups()}
    timer = _by_kernel({("BlockLinear", "Q4_K"): 3e-4, ("Int4Linear", None): 2e-4, ("BlockLinear", "Q6_K"): 1e-4,
                        ("BlockLinear", "Q5_K"): 1e-4, ("Linear", None): 3e-4})
    verdicts = kernel_choice.choose(groups, {}, torch.bfloat16, cache=tmp_path / "c.json", timer=timer)
    path = block_gemv.path()
    assert verdicts["layers Q4_K"] == Verdict(
        "layers Q4_K", False, f"torch int4, 1.5x memra block kernel ({path}; measured at load, one row)")
    assert verdicts["layers Q6_K"] == Verdict(
        "layers Q6_K", True, f"memra block kernel, {path}, 3.0x dense bfloat16 (measured at load, one row)")
    assert verdicts["layers Q5_K"].blocks  # 48 rows: no int4 packing needed, the dense weight is the other kernel
    assert verdicts["head Q8_0"].blocks  # as measured offline, and the 4-bit layers interleaved where the build does
    assert verdicts["layers Q4_0"].blocks == block_gemv.interleaves()
    assert len(json.loads((tmp_path / "c.json").read_text())) == 3  # the three k-quant groups, kept
