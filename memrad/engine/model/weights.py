"""Swap a loaded model's linear layers for packed ones, from the GGUF the model came from.

The model is first loaded as floats from the converted folder (prefill runs those). Then,
for `--weights int4`, every Q4_0/Q4_1 tensor of the GGUF is matched to the Linear it became
(transformers' own GGUF name map), its rows put in transformers' order (llama's Q/K are
stored permuted for llama.cpp's rope: the permutation is recovered by running transformers'
tensor processor over row indices), and checked once, at conversion: its dequantized blocks
must equal the float32 weight transformers made of it, bit for bit. A tensor that fails stays
float, so a mapping error can cost speed but never change the weights. The checked blocks
are kept as shipped (codes, d, m) in the converted folder, so a start reads no GGUF.

Q4_K tensors (k-quant super-blocks) become the same int4 blocks, one scale and min per
32-weight sub-block; Q8_0 and Q5_0 tensors become int8-coded blocks, run hi|lo on the same
kernel (Q8Linear); unquantized tensors stay dense (memrad.engine.model.quant says why,
memrad.engine.model.formats what each group runs as). Every k-quant tensor (Q4_K, Q5_K, Q6_K)
is also kept as its shipped super-blocks (SuperBlocks, K_CACHE) for memra's block kernel; where
that kernel does not run or loses, Q4_K runs on the int4 kernel and Q5_K, Q6_K stay dense.
All are checked as above.

The output head gets the same treatment when the GGUF ships it as Q8_0 (llama.cpp's default
for a tied head: `token_embd.weight`, which the head shares with the input embedding): its
blocks are checked against the head's float weight, kept in a sibling file (Q8_CACHE: older
memrad never opens it), and run by a Q8Linear (memrad.engine.model.quant). The embedding keeps the
float weight it shares with the head. A folder made before memra kept the head loads with a
dense head and says what adds it.

Where memra's block kernel runs, the blocks it wins on run there as shipped instead (BlockLinear;
which groups: memrad.engine.model.kernel_choice, the head on AVX512, each group measured on
AVX2); they are rebuilt at load and left out of the packed file, whose stamp names them.

Packing for the kernels takes seconds, so the packed layers are kept too, one file per device
and torch build, stamped with the block files they were made from: new blocks, new packing.

    memra-q4-blocks.safetensors     {layer}.codes/.scales/.mins       the GGUF's Q4 blocks
    memra-q8-blocks.safetensors     {layer}.codes/.scales             its Q8_0 / Q5_0 tensors and
                                                                      Q8_0 head (maybe none);
                                    header: "kinds", every Linear's GGUF type
    memra-k-blocks.safetensors      {layer}.Q4_K / .Q5_K / .Q6_K      its k-quant tensors' bytes
                                                                      as shipped (maybe none)
    memra-expert-blocks.safetensors {layer}.mlp.experts.gate_up.KIND  gpt-oss's and Qwen3-MoE's experts
                                    / .down.KIND                      as shipped (MXFP4, Q4_K, Q6_K, ...:
                                                                      memrad.engine.model.block_experts)
    memra-int4-{device}-{dtype}-torch{version}.safetensors
                                    {layer}.packed/.scales_and_zeros  Int4Linear
                                    {head}.q8_packed/.q8_scales_and_zeros  Q8Linear
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memrad.durable import publish
from memrad.engine.kernels import block_gemv
from memrad.engine.model import block_experts, block_linear, formats, kernel_choice
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.hardware import Choice
from memrad.engine.model.quant import (
    Int4Blocks, Int4Linear, Int8Blocks, Int8Linear, Q8Linear, SuperBlocks, packed_bytes, quantize_q4_1, unpack_blocks,
    unpack_q4_k, unpack_q5_0, unpack_q8_0,
)

log = logging.getLogger("memrad.engine")

INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")
INT8_KINDS = ("Q8_0", "Q5_0")  # int8-coded blocks, run hi|lo
K_KINDS = ("Q4_K", "Q5_K", "Q6_K")  # k-quants, kept as shipped super-blocks too (SuperBlocks)
# What the block files' contents mean; pull adds them again to a folder stamped otherwise.
# 2: Q4_K, Q5_0 and every Q8_0 tensor (1: Q4_0/Q4_1 and the Q8_0 head only), the "kinds" header.
BLOCKS_LAYOUT = "2"
# Next to the converted float weights: the GGUF's 4-bit blocks, as shipped (codes, d, m).
INT4_CACHE = "memra-q4-blocks.safetensors"
# Beside it: the Q8_0 / Q5_0 blocks, the head's among them (none when the GGUF ships none).
Q8_CACHE = "memra-q8-blocks.safetensors"
# Beside them: the k-quant tensors' super-blocks, their bytes as shipped (none when it ships none).
K_CACHE = "memra-k-blocks.safetensors"
# What the packed file's layout means; a file stamped otherwise is packed again.
# 2: Q4_0 zeros fixed (1 packed them as Q4_1 with m = 0), and the Q8_0 head.
PACKED_LAYOUT = "2"
# Packed-file key suffixes per layer class; memrad before the Q8 head reads only ".packed".
_PACKED_KEYS: dict[type, tuple[str, str]] = {Int4Linear: (".packed", ".scales_and_zeros"),
                                             Q8Linear: (".q8_packed", ".q8_scales_and_zeros")}
Packed = dict[str, tuple[type, torch.Tensor, torch.Tensor]]  # {module: (layer class, codes, scales_and_zeros)}


@dataclass(frozen=True, slots=True)
class WeightsApplied:
    """What `apply_weights` did: layers packed (the head among them), layers left float,
    bytes packed, and how the output head runs (`head_format`)."""

    packed: int
    left_float: int
    packed_bytes: int
    note: str
    head: str = "float"
    groups: tuple = ()  # memrad.engine.model.formats.TensorGroup: what each tensor group runs as
    reasons: dict = field(default_factory=dict)  # {module name: which kernel runs its blocks and why}


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """What `read_gguf_blocks` found: blocks in model row order, and every Linear's GGUF type."""

    int4: dict[str, Int4Blocks]  # Q4_0 / Q4_1 / Q4_K
    int8: dict[str, Int8Blocks]  # Q8_0 / Q5_0 (the head among them when it ships as Q8_0)
    head_kind: str  # the head tensor's GGUF type ("none" if absent)
    kinds: dict[str, str]  # {module name: GGUF type} for every Linear the GGUF holds
    super_blocks: dict[str, SuperBlocks] = field(default_factory=dict)  # Q4_K / Q5_K / Q6_K as shipped


def read_gguf_blocks(gguf_path: Path, model: Any) -> GGUFBlocks:
    """The GGUF's blocks for `model`'s Linear layers, in model row order.

    Slow (gguf's reader parses all metadata; docs/BENCHMARKS.md, Startup and compile): run once, at
    conversion, and kept in the folder's block caches (`save_block_caches`).
    """
    from gguf import GGUFReader, MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(gguf_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    arch_id = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None:
        return GGUFBlocks({}, {}, "none", {})
    name_map = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    gguf_to_module = {f"{name_map.get_name(name)}.weight": name for name, mod in model.named_modules()
                      if isinstance(mod, torch.nn.Linear) and name_map.get_name(name) is not None}
    head, head_name = model.get_output_embeddings(), _head_name(model)
    embedding = model.get_input_embeddings()
    if head is not None and embedding is not None and head.weight is embedding.weight:
        # tied: the GGUF ships no output.weight; token_embd.weight is the head too
        embedding_name = next(name for name, mod in model.named_modules() if mod is embedding)
        gguf_to_module.setdefault(f"{name_map.get_name(embedding_name)}.weight", head_name)
    int4: dict[str, Int4Blocks] = {}
    q8: dict[str, Int8Blocks] = {}
    whole: dict[str, SuperBlocks] = {}
    kinds: dict[str, str] = {}
    experts_at = "experts" if getattr(model.config, "enable_moe_block", False) else "mlp.experts"  # Gemma 4: the layer's
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        experts = block_experts.EXPERT_TENSORS.fullmatch(tensor.name)
        if experts:  # 3-D experts (not Linear: they stay dense); their type is said in `memrad status`
            weight = "down_proj" if experts["part"] == "down" else "gate_up_proj"  # transformers joins gate and up
            name = f"model.layers.{experts['layer']}.{experts_at}.{weight}"
            kinds[name] = kind if kinds.get(name, kind) == kind else f"{kinds[name]}+{kind}"
            continue
        module = gguf_to_module.get(tensor.name)
        if module is None:
            continue
        kinds[module] = kind
        if kind not in INT4_KINDS + INT8_KINDS + K_KINDS:
            continue
        raw = np.array(tensor.data)  # [N, bytes a row] uint8
        rows = _row_order(processor, tensor.name, raw.shape[0])
        if kind in K_KINDS:
            shipped = SuperBlocks(kind, torch.from_numpy(np.ascontiguousarray(raw)))
            whole[module] = shipped if rows is None else shipped.permuted(rows)
        if kind in INT4_KINDS + INT8_KINDS:
            blocks = {"Q4_K": unpack_q4_k, "Q5_0": unpack_q5_0, "Q8_0": unpack_q8_0}.get(
                kind, lambda data: unpack_blocks(data, kind))(raw)
            (int4 if kind in INT4_KINDS else q8)[module] = blocks if rows is None else blocks.permuted(rows)
    return GGUFBlocks(int4, q8, kinds.get(head_name, "none"), kinds, whole)


def save_block_caches(gguf_path: Path, model: Any, folder: Path) -> tuple[int, int, int]:
    """Write the GGUF's int4 blocks, int8-coded blocks and k-quant super-blocks that match
    `model`'s float weights bit for bit into `folder`; returns how many of each. `model` must
    hold the float32 weights the folder was made of (for a tied head: the embedding's)."""
    found = read_gguf_blocks(gguf_path, model)
    int4, q8, whole = _matching(found.int4, model), _matching(found.int8, model), _matching(found.super_blocks, model)
    write_int4_cache(int4, folder, gguf_path.name)
    write_q8_cache(q8, folder, gguf_path.name, found.head_kind, found.kinds)
    write_super_cache(whole, folder, gguf_path.name)
    return len(int4), len(q8), len(whole)


def _matching(blocks: dict, model: Any) -> dict:
    """The entries of {module name: blocks} whose dequantized weights equal the module's."""
    modules = dict(model.named_modules())
    kept = {}
    for name, block in blocks.items():
        weight = modules[name].weight.detach().cpu()
        if tuple(weight.shape) != tuple(block.shape) or not torch.equal(block.dequantize(), weight.float()):
            log.warning("GGUF tensor for %s does not match the float weights: it stays float", name)
            continue
        kept[name] = block
    return kept


def write_int4_cache(blocks: dict[str, Int4Blocks], folder: Path, source: str) -> None:
    """Store {module name: blocks} in `folder`: codes one a byte (unpacking two a byte cost
    seconds at every start), d and m as the fp16 they were shipped as."""
    _write_blocks(folder / INT4_CACHE, blocks, {"source": source})


def write_q8_cache(blocks: dict[str, Int8Blocks], folder: Path, source: str, head_kind: str,
                   kinds: dict[str, str] | None = None) -> None:
    """Store the int8-coded blocks ({} when there are none), the GGUF type the head was
    shipped as and every Linear's (`kinds`): the file's presence says the head was looked at,
    its header why a layer is dense."""
    _write_blocks(folder / Q8_CACHE, blocks, {"source": source, "head": head_kind,
                                              "kinds": json.dumps(kinds or {}, sort_keys=True)})


def write_super_cache(blocks: dict[str, SuperBlocks], folder: Path, source: str) -> None:
    """Store the k-quant super-blocks ({} when there are none), each under `{name}.{kind}`."""
    from safetensors.torch import save_file

    path = folder / K_CACHE
    staging = path.with_name(path.name + ".partial")
    save_file({f"{name}.{block.kind}": block.raw.contiguous() for name, block in blocks.items()}, str(staging),
              metadata={"source": source, "layout": BLOCKS_LAYOUT})
    publish(staging, path)


def load_super_cache(folder: Path) -> dict[str, SuperBlocks]:
    """The folder's k-quant super-blocks ({} when it has none, or no file: converted before memra kept them)."""
    if not (folder / K_CACHE).is_file():
        return {}
    from safetensors.torch import load_file

    return {name: SuperBlocks(kind, raw) for key, raw in load_file(str(folder / K_CACHE)).items()
            for name, _, kind in [key.rpartition(".")]}


def _write_blocks(path: Path, blocks: dict[str, Int4Blocks | Int8Blocks], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, block in blocks.items():
        tensors[f"{name}.codes"] = block.codes.contiguous()  # [N, K] uint8 0..15 or int8
        # fp16 where exact (Q4_0/Q4_1/Q5_0/Q8_0 ship fp16 d); Q4_K's d·sc needs float32
        half = block.scales.half()
        tensors[f"{name}.scales"] = half if torch.equal(half.float(), block.scales) else block.scales
        if getattr(block, "mins", None) is not None:
            half = block.mins.half()
            tensors[f"{name}.mins"] = half if torch.equal(half.float(), block.mins) else block.mins
    staging = path.with_name(path.name + ".partial")
    save_file(tensors, str(staging), metadata={**metadata, "layout": BLOCKS_LAYOUT})
    publish(staging, path)


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


def quantize_head_q8_0(model: Any) -> dict[str, Int8Blocks]:
    """Round the output head to Q8_0 in place with gguf-py's quantizer (bit-exact with
    llama.cpp; a tied head rounds the embedding it shares) and return {head name: blocks}:
    the head llama.cpp ships with SmolLM2, for tests and the random-weight model."""
    from gguf import GGMLQuantizationType, quants

    head = model.get_output_embeddings()
    blocks = unpack_q8_0(quants.quantize(head.weight.detach().float().numpy(), GGMLQuantizationType.Q8_0))
    with torch.no_grad():
        head.weight.copy_(blocks.dequantize())
    return {_head_name(model): blocks}


def count_int4_cache(folder: Path) -> int:
    """How many int4 weight matrices the folder's cache holds (0 without one)."""
    return len(_cached_names(folder / INT4_CACHE))


def count_q8_cache(folder: Path) -> int:
    """How many Q8_0 weight matrices (the head, or none) the folder's cache holds."""
    return len(_cached_names(folder / Q8_CACHE))


def _cached_names(path: Path) -> list[str]:
    if not path.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        if path.name == K_CACHE:
            return [key.rpartition(".")[0] for key in f.keys()]
        return [key.removesuffix(".codes") for key in f.keys() if key.endswith(".codes")]


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


def load_q8_cache(folder: Path) -> dict[str, Int8Blocks]:
    """The folder's Q8_0 blocks ({} when it has none, or no file: made before memra kept them)."""
    if not (folder / Q8_CACHE).is_file():
        return {}
    from safetensors.torch import load_file

    tensors = load_file(str(folder / Q8_CACHE))
    names = [key.removesuffix(".codes") for key in tensors if key.endswith(".codes")]
    return {name: Int8Blocks(tensors[f"{name}.codes"], tensors[f"{name}.scales"].float()) for name in names}


def load_kinds(folder: Path) -> dict[str, str]:
    """{module name: GGUF type} for every Linear the folder's GGUF held ({} without a GGUF, or
    for a folder converted before memra kept them)."""
    path = folder / Q8_CACHE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("kinds", "{}"))


def head_format(model: Any) -> str:
    """How the output head runs: "q8_0" (its GGUF blocks as int4 hi|lo), "q8_0 blocks" (as
    shipped, memra's kernel), "int4", "int8" or "float". It decides the logits' bits, so the disk
    tier's compatibility key names it."""
    head = model.get_output_embeddings()
    if isinstance(head, BlockLinear):
        return f"{head.format.lower()} blocks"
    return {Q8Linear: "q8_0", Int4Linear: "int4", Int8Linear: "int8"}.get(type(head), "float")


def _head_name(model: Any) -> str | None:
    head = model.get_output_embeddings()
    return next((name for name, mod in model.named_modules() if mod is head), None)


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
        applied = _apply_int4(model, folder, kernel_dtype)
    elif choice.value == "int8":
        targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
        for name, mod in targets:
            _set_module(model, name, Int8Linear(mod))
        applied = WeightsApplied(len(targets), 0, packed_bytes(model), "per-channel int8", head_format(model))
    else:
        applied = WeightsApplied(0, 0, 0, "float")
    head_why = _blocks_why_not(model) if applied.head == "q8_0" else None
    return replace(applied, groups=formats.groups(model, load_kinds(folder),
                                                  f"memra's block kernel: {head_why}" if head_why else None,
                                                  applied.reasons))


def _blocks_why_not(model: Any) -> str | None:
    """Why the Q8_0 head does not run as shipped on memra's kernel (None: it does)."""
    device = next(model.parameters()).device
    return block_gemv.why_not() if device.type == "cpu" else f"it is CPU-only ({device.type})"


def _apply_int4(model: Any, folder: Path, kernel_dtype: torch.dtype) -> WeightsApplied:
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    # The blocks memra's kernel runs as shipped, where it runs and wins (memrad.engine.model.kernel_choice:
    # on AVX512 the Q8_0 head and the 4-bit layers (interleaved), measured once, and the k-quants
    # measured here; on AVX2 each group measured here, interleaved or row-major), else torch's int4
    # kernel (Q5_K, Q6_K: dense).
    verdicts, groups = _block_plan(model, folder, modules)
    on_blocks = {name: blocks for group, members in groups.items() if verdicts[group].blocks
                 for name, blocks in members.items()}
    interleaved = {name for group, members in groups.items() if verdicts[group].interleaved for name in members}
    stamp = _blocks_stamp(folder) + _blocks_suffix(set(on_blocks), _head_name(model))
    packed = _load_packed(folder, device, kernel_dtype, stamp)
    built = packed is None
    if built:  # first start on this device / torch / block files: pack, keep the result
        packed = _pack_cached(folder, modules, kernel_dtype, skip=set(on_blocks))
    for name, (cls, codes, scales_and_zeros) in packed.items():
        _set_module(model, name, cls(modules[name], codes, scales_and_zeros))
    if built:
        _save_packed(folder, device, kernel_dtype, packed, stamp)
    for name, blocks in on_blocks.items():  # packing them takes a second: not kept in the packed file
        _set_module(model, name, BlockLinear.from_blocks(modules[name], blocks, name in interleaved))
    # gpt-oss's and Qwen3-MoE's experts: the chosen experts' blocks for one token wherever memra's kernel runs
    experts = block_experts.install(model, folder) if _blocks_why_not(model) is None else 0
    as_blocks = len(on_blocks)
    head = head_format(model)
    if head == "float":  # a warning where a pull would change that
        level = logging.INFO if (folder / Q8_CACHE).is_file() else logging.WARNING
        log.log(level, "the output head runs dense: %s", _why_dense_head(folder, model))
    cached = len({*_cached_names(folder / INT4_CACHE), *_cached_names(folder / Q8_CACHE), *on_blocks})
    layers_on_blocks = as_blocks - (head.endswith("blocks"))
    note = (f"int4 group 32 ({INT4_CACHE})" + (f" + {layers_on_blocks} layers as shipped on memra's kernel"
                                                if layers_on_blocks else "")
            + (" + Q8_0 head as shipped on memra's kernel" if head.endswith("blocks") else
               " + Q8_0 head as int4 hi|lo" if head == "q8_0" else "")
            + (f" + {experts} layers' {' / '.join(block_experts.kept_kinds(folder)[1])} experts as shipped "
               "on memra's kernel" if experts else ""))
    block_bytes = sum(sum(b.nbytes for b in m.buffers(recurse=False)) for m in model.modules()
                      if isinstance(m, (BlockLinear, block_experts.BlockMoE)))
    reasons = {name: verdicts[group].reason for group, members in groups.items() for name in members
               if verdicts[group].reason}
    reasons.update(_why_dense_k_quants(model, folder, reasons))
    return WeightsApplied(len(packed) + as_blocks, cached - len(packed) - as_blocks, packed_bytes(model) + block_bytes,
                          note, head, reasons=reasons)


def _block_plan(model: Any, folder: Path, modules: dict[str, torch.nn.Module]
                ) -> tuple[dict[str, kernel_choice.Verdict], dict[str, dict[str, kernel_choice.Blocks]]]:
    """({group: verdict}, {group: {module name: blocks}}): the groups of blocks memra's kernel could
    run as shipped and where it does (none where the kernel does not run). A k-quant tensor is a
    candidate as its super-blocks (a Q4_K one's int4 blocks are the other kernel's)."""
    if _blocks_why_not(model) is not None:
        return {}, {}
    head_name = _head_name(model)
    int8 = load_q8_cache(folder)
    if block_gemv.capability() in kernel_choice.MEASURED_ON:
        candidates = {**load_int4_cache(folder), **int8}
    else:  # measured offline: of the shipped blocks the head and, interleaved, the 4-bit layers run on the kernel
        candidates = {head_name: int8[head_name]} if head_name in int8 else {}
        if block_gemv.interleaves():
            candidates.update(load_int4_cache(folder))
    candidates.update(load_super_cache(folder))
    groups = kernel_choice.packable_groups(candidates, load_kinds(folder), head_name,
                                           lambda name, blocks: _fits(modules.get(name), blocks,
                                                                      rows_in_sixteens=False))
    return kernel_choice.choose(groups, modules, next(model.parameters()).dtype), groups


def _why_dense_k_quants(model: Any, folder: Path, reasons: dict[str, str]) -> dict[str, str]:
    """{module name: why} for the Q5_K / Q6_K layers left dense with no verdict: memra's block kernel
    does not run here, or the folder keeps no super-blocks (an older memrad converted it)."""
    kinds, kept = load_kinds(folder), set(_cached_names(folder / K_CACHE))
    why_not = _blocks_why_not(model)
    out = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and kinds.get(name) in ("Q5_K", "Q6_K") and name not in reasons:
            out[name] = (f"memra's block kernel: {why_not}" if why_not else
                         "no super-blocks kept (converted by an older memrad): `memrad pull` adds them"
                         if name not in kept else "its super-blocks do not fit the layer")
    return out


def _blocks_suffix(names: set[str], head_name: str | None) -> str:
    """What the packed file's stamp adds for the layers left out of it (they run on memra's kernel)."""
    if not names:
        return ""
    if names == {head_name}:
        return "; head as blocks"
    return f"; as blocks {hashlib.sha256(chr(0).join(sorted(names)).encode()).hexdigest()[:16]}"


def _pack_cached(folder: Path, modules: dict[str, torch.nn.Module], kernel_dtype: torch.dtype,
                 skip: set[str] = frozenset()) -> Packed:
    """Pack the folder's cached blocks for the layers of `modules` they fit, but those in `skip`."""
    layers = [(name, Int4Linear.from_blocks(modules[name], blocks, kernel_dtype))
              for name, blocks in load_int4_cache(folder).items() if _fits(modules.get(name), blocks) and name not in skip]
    layers += [(name, Q8Linear.from_blocks(modules[name], blocks, kernel_dtype))
               for name, blocks in load_q8_cache(folder).items() if _fits(modules.get(name), blocks) and name not in skip]
    return {name: (type(layer), layer.packed, layer.scales_and_zeros) for name, layer in layers}


def _fits(module: torch.nn.Module | None, blocks: Int4Blocks | Int8Blocks, rows_in_sixteens: bool = True) -> bool:
    # the CPU int4 packer takes N in multiples of 16 (a vocabulary need not be one); memra's block kernel any N
    return (type(module) is torch.nn.Linear and tuple(module.weight.shape) == tuple(blocks.shape)
            and (module.out_features % 16 == 0 or not rows_in_sixteens))


def _why_dense_head(folder: Path, model: Any) -> str:
    """Why a model with int4 layers runs no Q8_0 head, with what to run if anything does."""
    path = folder / Q8_CACHE
    if not path.is_file():
        return (f"{folder} was made before memra kept the head's Q8_0 blocks; `memrad pull` (the "
                "default model) or `memrad pull FILE.gguf` (a GGUF) adds them")
    if count_q8_cache(folder):
        return f"the int4 kernel packs rows in sixteens and it has {model.get_output_embeddings().out_features}"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        kind = (f.metadata() or {}).get("head", "none")
    if kind == "Q8_0":
        return "its Q8_0 blocks did not match the float weights at conversion"
    return f"the GGUF ships it as {kind}, not Q8_0" if kind != "none" else "the GGUF names no output head"


def _blocks_stamp(folder: Path) -> str:
    """What a packed file was made from: the layout and the block files as written (size and
    time: a rewrite of equal size, e.g. another seed's random model, packs again)."""
    files = [f"{(folder / name).stat().st_size}@{(folder / name).stat().st_mtime_ns}"
             if (folder / name).is_file() else "absent" for name in (INT4_CACHE, Q8_CACHE)]
    return f"layout {PACKED_LAYOUT}; q4 {files[0]}; q8 {files[1]}"


def _packed_path(folder: Path, device: torch.device, kernel_dtype: torch.dtype) -> Path:
    """The kernel's own layout depends on the device and the torch build: one file per pair."""
    dtype = str(kernel_dtype).removeprefix("torch.")
    return folder / f"memra-int4-{device.type}-{dtype}-torch{torch.__version__}.safetensors"


def _load_packed(folder: Path, device: torch.device, kernel_dtype: torch.dtype, stamp: str) -> Packed | None:
    """The kept packed layers, or None without a file made from these blocks in this layout."""
    path = _packed_path(folder, device, kernel_dtype)
    if not path.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get("memra") != stamp:
            return None
    tensors = load_file(str(path))
    return {key.removesuffix(codes_key): (cls, tensors[key], tensors[key.removesuffix(codes_key) + sz_key])
            for cls, (codes_key, sz_key) in _PACKED_KEYS.items() for key in tensors if key.endswith(codes_key)}


def _save_packed(folder: Path, device: torch.device, kernel_dtype: torch.dtype, packed: Packed, stamp: str) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, (cls, codes, scales_and_zeros) in packed.items():
        codes_key, sz_key = _PACKED_KEYS[cls]
        tensors[name + codes_key] = codes.cpu().contiguous()
        tensors[name + sz_key] = scales_and_zeros.cpu().contiguous()
    path = _packed_path(folder, device, kernel_dtype)
    try:
        save_file(tensors, str(path.with_suffix(".partial")), metadata={"memra": stamp})
        publish(path.with_suffix(".partial"), path)
    except OSError as exc:  # a read-only folder: the next start packs again
        log.warning("could not keep the packed int4 weights in %s: %s", folder, exc)


def _set_module(model: Any, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)
