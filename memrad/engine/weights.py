"""Swap a loaded model's linear layers for packed ones, from the GGUF the model came from.

The model is first loaded as floats from the converted folder (prefill runs those). Then,
for `--weights int4`, every Q4_0/Q4_1 tensor of the GGUF is matched to the Linear it became
(transformers' own GGUF name map), its rows put in transformers' order (llama's Q/K are
stored permuted for llama.cpp's rope: the permutation is recovered by running transformers'
tensor processor over row indices), and checked once, at conversion: its dequantized blocks
must equal the float32 weight transformers made of it, bit for bit. A tensor that fails stays
float, so a mapping error can cost speed but never change the weights. The checked blocks
are kept as shipped (codes, d, m) in the converted folder, so a start reads no GGUF.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memrad.engine.hardware import Choice
from memrad.engine.quant import Int4Blocks, Int4Linear, Int8Linear, packed_bytes, quantize_q4_1, unpack_blocks

log = logging.getLogger("memrad.engine")

INT4_KINDS = ("Q4_0", "Q4_1")
# Next to the converted float weights: the GGUF's 4-bit blocks, as shipped (codes, d, m).
INT4_CACHE = "memra-q4-blocks.safetensors"


@dataclass(frozen=True, slots=True)
class WeightsApplied:
    """What `apply_weights` did: layers packed, layers left float (and why), bytes packed."""

    packed: int
    left_float: int
    packed_bytes: int
    note: str


def read_int4_blocks(gguf_path: Path, model: Any) -> dict[str, Int4Blocks]:
    """Q4_0/Q4_1 weights of `gguf_path` as {module name in `model`: blocks in model row order}.

    Slow (gguf's reader parses all metadata, ~10 s for the default model): run once, at
    conversion, and kept in the folder's int4 cache (`save_int4_cache`).
    """
    from gguf import GGUFReader, MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(gguf_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    arch_id = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None:
        return {}
    name_map = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    gguf_to_module = {f"{name_map.get_name(name)}.weight": name for name, mod in model.named_modules()
                      if isinstance(mod, torch.nn.Linear) and name_map.get_name(name) is not None}
    out: dict[str, Int4Blocks] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        module = gguf_to_module.get(tensor.name)
        if kind not in INT4_KINDS or module is None:
            continue
        blocks = unpack_blocks(np.array(tensor.data), kind)
        rows = _row_order(processor, tensor.name, blocks.codes.shape[0])
        out[module] = blocks if rows is None else blocks.permuted(rows)
    return out


def save_int4_cache(gguf_path: Path, model: Any, folder: Path) -> int:
    """Write the GGUF's int4 blocks that match `model`'s float weights bit for bit into
    `folder`; returns how many. `model` must hold the float32 weights the folder was made of."""
    modules = dict(model.named_modules())
    kept: dict[str, Int4Blocks] = {}
    for name, blocks in read_int4_blocks(gguf_path, model).items():
        weight = modules[name].weight.detach().cpu()
        if tuple(weight.shape) != tuple(blocks.codes.shape) or not torch.equal(blocks.dequantize(), weight.float()):
            log.warning("GGUF tensor for %s does not match the float weights: it stays float", name)
            continue
        kept[name] = blocks
    write_int4_cache(kept, folder, gguf_path.name)
    return len(kept)


def write_int4_cache(blocks: dict[str, Int4Blocks], folder: Path, source: str) -> None:
    """Store {module name: blocks} in `folder`: codes one a byte (unpacking two a byte cost
    seconds at every start), d and m as the fp16 they were shipped as."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, block in blocks.items():
        tensors[f"{name}.codes"] = block.codes.contiguous()  # [N, K] uint8 0..15
        tensors[f"{name}.scales"] = block.scales.half()  # exact: they were fp16 in the GGUF
        if block.mins is not None:
            tensors[f"{name}.mins"] = block.mins.half()
    staging = folder / (INT4_CACHE + ".partial")
    save_file(tensors, str(staging), metadata={"source": source})
    staging.rename(folder / INT4_CACHE)


def quantize_layers_q4_1(model: Any) -> dict[str, Int4Blocks]:
    """Round every Linear but the output head to Q4_1 in place (the weight becomes its
    dequantized blocks) and return the blocks: a float model shaped like a GGUF's, for tests
    and the random-weight model. The head stays float, as llama.cpp ships it at 8 bits or more."""
    head = model.get_output_embeddings()
    out: dict[str, Int4Blocks] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and module is not head and module.in_features % 32 == 0:
                blocks = quantize_q4_1(module.weight)
                module.weight.copy_(blocks.dequantize())
                out[name] = blocks
    return out


def count_int4_cache(folder: Path) -> int:
    """How many int4 weight matrices the folder's cache holds (0 without one)."""
    path = folder / INT4_CACHE
    if not path.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(key.endswith(".codes") for key in f.keys())


def load_int4_cache(folder: Path) -> dict[str, Int4Blocks]:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / INT4_CACHE))
    out: dict[str, Int4Blocks] = {}
    for key in tensors:
        if key.endswith(".codes"):
            name = key.removesuffix(".codes")
            mins = tensors.get(f"{name}.mins")
            out[name] = Int4Blocks(tensors[key], tensors[f"{name}.scales"].float(),
                                   None if mins is None else mins.float())
    return out


def _row_order(processor: Any, gguf_name: str, num_rows: int) -> torch.Tensor | None:
    """The row permutation transformers applies to this tensor, or None if it keeps the order."""
    index = np.arange(num_rows, dtype=np.float64)[:, None]
    moved = np.asarray(processor.process(weights=index, name=gguf_name).weights).reshape(-1)
    if moved.shape != (num_rows,) or np.array_equal(moved, index[:, 0]):
        return None
    return torch.from_numpy(moved.astype(np.int64))


def apply_weights(model: Any, choice: Choice, folder: Path, kernel_dtype: torch.dtype) -> WeightsApplied:
    """Replace `model`'s Linear layers as `choice` says (in place); returns what was done."""
    if choice.value == "int4":
        return _apply_int4(model, folder, kernel_dtype)
    if choice.value == "int8":
        targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
        for name, mod in targets:
            _set_module(model, name, Int8Linear(mod))
        return WeightsApplied(len(targets), 0, packed_bytes(model), "per-channel int8")
    return WeightsApplied(0, 0, 0, "float")


def _apply_int4(model: Any, folder: Path, kernel_dtype: torch.dtype) -> WeightsApplied:
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    packed = _load_packed(folder, device, kernel_dtype)
    built = packed is None
    if built:  # first start on this device / torch: pack from the blocks, keep the result
        packed = {name: (layer.packed, layer.scales_and_zeros) for name, layer in
                  ((name, Int4Linear.from_blocks(modules[name], blocks, kernel_dtype))
                   for name, blocks in load_int4_cache(folder).items()
                   if type(modules.get(name)) is torch.nn.Linear
                   and tuple(modules[name].weight.shape) == tuple(blocks.codes.shape))}
    for name, (codes, scales_and_zeros) in packed.items():
        _set_module(model, name, Int4Linear(modules[name], codes, scales_and_zeros))
    if built:
        _save_packed(folder, device, kernel_dtype, packed)
    return WeightsApplied(len(packed), count_int4_cache(folder) - len(packed), packed_bytes(model),
                          f"int4 group 32 ({INT4_CACHE})")


def _packed_path(folder: Path, device: torch.device, kernel_dtype: torch.dtype) -> Path:
    """The kernel's own layout depends on the device and the torch build: one file per pair."""
    dtype = str(kernel_dtype).removeprefix("torch.")
    return folder / f"memra-int4-{device.type}-{dtype}-torch{torch.__version__}.safetensors"


def _load_packed(folder: Path, device: torch.device, kernel_dtype: torch.dtype
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    path = _packed_path(folder, device, kernel_dtype)
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return {key.removesuffix(".packed"): (tensors[key], tensors[key.removesuffix(".packed") + ".scales_and_zeros"])
            for key in tensors if key.endswith(".packed")}


def _save_packed(folder: Path, device: torch.device, kernel_dtype: torch.dtype,
                 packed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, (codes, scales_and_zeros) in packed.items():
        tensors[f"{name}.packed"] = codes.cpu().contiguous()
        tensors[f"{name}.scales_and_zeros"] = scales_and_zeros.cpu().contiguous()
    path = _packed_path(folder, device, kernel_dtype)
    try:
        save_file(tensors, str(path.with_suffix(".partial")))
        path.with_suffix(".partial").rename(path)
    except OSError as exc:  # a read-only folder: the next start packs again
        log.warning("could not keep the packed int4 weights in %s: %s", folder, exc)


def _set_module(model: Any, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)
