"""Filling a transformers model from a GGUF's tensors by one table of llama.cpp's names.

Where transformers' GGUF loader cannot place an architecture's tensors (gpt-oss's experts, Gemma 4's
layout: memrad.engine.model.gguf_gpt_oss, memrad.engine.model.gguf_gemma4), memra builds the model
from its config and sets every parameter (and persistent buffer, such as Gemma 4's layer scalars)
from the tensor a `Table` names for it, dequantised with gguf-py. A tensor the table does not
name, a tensor of another shape than its parameter (or its columns), or a parameter no tensor
fills is refused (ModelUnavailable) by name, so a layout memra does not know never loads as
half-initialised weights. `unplaced` says before the wait which tensors a file ships that the
table does not name (memrad.engine.model.preflight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from memrad.engine.model.unavailable import ModelUnavailable

ALL = slice(None)  # every column of the parameter's last dim
_BLOCK = re.compile(r"blk\.(?P<layer>\d+)\.(?P<rest>.+)")


@dataclass(frozen=True, slots=True)
class Place:
    """Where one GGUF tensor goes: the parameter, the columns of its last dim it fills, which half
    of its next-to-last dim (None: all of it; Gemma 4's split ffn_gate_exps and ffn_up_exps fill
    gate_up_proj's first and second I rows), and whether llama.cpp stores it transposed (an
    expert's rows are its outputs)."""

    name: str
    columns: slice = field(default_factory=lambda: ALL)
    transposed: bool = False
    half: int | None = None


@dataclass(frozen=True, slots=True)
class Table:
    """llama.cpp's tensor names for one architecture: whole-model ones, the ones after "blk.N."
    (placed in layer N, "model.layers.N." prefixed), and the tensors the config is read from
    rather than a parameter (Gemma 4's rope_freqs)."""

    architecture: str  # as llama.cpp writes it, for the refusals
    whole: dict[str, Place]
    layer: dict[str, Place]
    layout: frozenset[str] = field(default_factory=frozenset)

    def place(self, gguf_name: str) -> Place | None:
        """Where `gguf_name` goes; None for a layout tensor; ModelUnavailable for a name the table
        does not know."""
        if gguf_name in self.layout:
            return None
        if gguf_name in self.whole:
            return self.whole[gguf_name]
        block = _BLOCK.fullmatch(gguf_name)
        if block is None or block["rest"] not in self.layer:
            raise ModelUnavailable(f"memra does not know where {self.architecture}'s {gguf_name} goes")
        at = self.layer[block["rest"]]
        return replace(at, name=f"model.layers.{block['layer']}.{at.name}")


def load(gguf_path: Path, table: Table, config: Any) -> tuple[Any, Any]:
    """(the model of `gguf_path` in float32 with the file's weights dequantised, its tokenizer):
    `config` read from the header (memrad.engine.model.preflight.gguf_config), the tokenizer with
    transformers' GGUF tokenizer reader (which needs no config), every weight by `table`."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fill(model, GGUFReader(gguf_path).tensors, gguf_path, table)
    return model, tokenizer


def unplaced(table: Table, names: Iterable[str]) -> list[str]:
    """The tensor names the table does not place, in the file's order."""
    missing = []
    for name in names:
        try:
            table.place(name)
        except ModelUnavailable:
            missing.append(name)
    return missing


def fill(model: Any, tensors: Any, source: Path, table: Table) -> None:
    """Set every parameter and persistent buffer of `model` from the GGUF `tensors` (gguf-py
    ReaderTensors) as `table` places them; raises ModelUnavailable for a tensor it does not place,
    one of another shape, or a parameter left unfilled."""
    from gguf import quants

    kept = model.state_dict().keys()
    targets = {**dict(model.named_parameters()),  # a tied head is the embedding's one parameter
               **{name: buffer for name, buffer in model.named_buffers() if name in kept}}
    filled: dict[str, set[tuple]] = {}
    for tensor in tensors:
        try:
            at = table.place(tensor.name)
        except ModelUnavailable as exc:
            raise ModelUnavailable(f"{source}: {exc}") from None
        if at is None:
            continue
        if at.name == "lm_head.weight" and at.name not in targets:
            raise ModelUnavailable(f"{source} ships output.weight but its config ties the head")
        if at.name not in targets:
            raise ModelUnavailable(f"{source}: {tensor.name} goes to {at.name}, which its config does not have")
        value = torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        value = value.transpose(-1, -2) if at.transposed else value
        with torch.no_grad():
            target = targets[at.name]
            target = (target if at.half is None else target.chunk(2, dim=-2)[at.half])[..., at.columns]  # a view
            if tuple(target.shape) != tuple(value.shape):
                raise ModelUnavailable(f"{source}: {tensor.name} is {tuple(value.shape)} where {at.name} takes "
                                       f"{tuple(target.shape)}")
            target.copy_(value)
        filled.setdefault(at.name, set()).add((at.columns.start, at.columns.step, at.half))
    whole = {(None, None, None)}, {(0, 2, None), (1, 2, None)}, {(None, None, 0), (None, None, 1)}
    missing = sorted(name for name in targets if filled.get(name) not in whole)
    if missing:
        raise ModelUnavailable(f"{source} fills no tensor for {named(missing)}")


def named(names: list[str]) -> str:
    """The first four of `names` and how many more."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
