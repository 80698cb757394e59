"""`auto` follows the hardware: the exact choice and the reason it gives, per CPU class."""

import pytest
import torch

from memrad.engine.model import hardware
from memrad.engine.model.hardware import Choice, native_bf16, pick_dtype, pick_weights

CPU = torch.device("cpu")


@pytest.fixture
def cpu_like(monkeypatch):
    def set_cpu(flags: dict, capability: str) -> None:
        monkeypatch.setattr(hardware.torch.cpu, "get_capabilities", lambda: flags)
        monkeypatch.setattr(hardware.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    return set_cpu


def test_avx512_bf16_with_avx512_kernels_picks_bf16(cpu_like):
    cpu_like({"avx512_bf16": True, "amx_bf16": False}, "AVX512")
    assert native_bf16({}) == Choice("yes", "the CPU has AVX512-BF16 (AVX512 kernels)")
    assert pick_dtype("auto", CPU) == (torch.bfloat16, Choice(
        "bfloat16", "auto: the CPU has AVX512-BF16 (AVX512 kernels)"))


def test_amx_is_named(cpu_like):
    cpu_like({"avx512_bf16": True, "amx_bf16": True}, "AMX")
    assert native_bf16({}).reason == "the CPU has AMX+AVX512-BF16 (AMX kernels)"


def test_an_avx2_only_cpu_stays_fp32(cpu_like):
    cpu_like({"avx2": True}, "AVX2")
    assert pick_dtype("auto", CPU) == (torch.float32, Choice(
        "float32", "auto: the CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated (5-6x slower)"))


def test_torch_capped_at_avx2_stays_fp32_even_on_a_bf16_cpu(cpu_like):
    cpu_like({"avx512_bf16": True}, "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert native_bf16({}) == Choice("no", "the CPU has AVX512-BF16 but torch runs AVX2 kernels (ATEN_CPU_CAPABILITY)")


def test_onednn_capped_below_bf16_stays_fp32(cpu_like):
    cpu_like({"avx512_bf16": True}, "AVX512")
    assert native_bf16({"ONEDNN_MAX_CPU_ISA": "avx2"}) == Choice(
        "no", "the CPU has AVX512-BF16 but oneDNN is capped at AVX2")
    assert native_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}).value == "yes"


def test_a_requested_dtype_is_taken_as_is(cpu_like):
    cpu_like({}, "AVX2")
    assert pick_dtype("bfloat16", CPU) == (torch.bfloat16, Choice("bfloat16", "set by model.dtype"))


def test_cuda_picks_bf16_without_looking_at_the_cpu():
    assert pick_dtype("auto", torch.device("cuda"))[1] == Choice("bfloat16", "auto: CUDA computes bf16 natively")


def test_auto_weights_run_shipped_4_bit_blocks_and_fall_back_to_float_with_the_reason():
    assert pick_weights("auto", CPU, 210, "the shipped Q4_1 GGUF") == Choice(
        "int4", "auto: as shipped, 210 Q4 tensors from the shipped Q4_1 GGUF (each group's kernel: the tensors line)")
    assert pick_weights("auto", CPU, 210, "the shipped Q4_1 GGUF", q8_head=True).reason == (
        "auto: as shipped, 210 Q4 tensors from the shipped Q4_1 GGUF and its Q8_0 head (each group's kernel: "
        "the tensors line)")
    assert pick_weights("auto", torch.device("cuda"), 4, "the GGUF").reason.endswith("on tinygemm")
    assert pick_weights("auto", CPU, 0, "the model is not a GGUF (no 4-bit blocks shipped)") == Choice(
        "float", "auto: the model is not a GGUF (no 4-bit blocks shipped)")
    assert pick_weights("float", CPU, 210, "x") == Choice("float", "set by model.weights")
    assert pick_weights("int8", CPU, 0, "x").value == "int8"
