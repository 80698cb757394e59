"""gpt-oss from a GGUF: the tensors transformers' GGUF loader cannot place, placed by memra.

transformers 5.24 reads gpt-oss's GGUF config wrongly (its rope keys fail) and maps no llama.cpp
tensor onto the experts' `gate_up_proj` or their biases, nor the sinks as llama.cpp names them
(tests/unit/test_gpt_oss.py pins it). So for a "gpt-oss" file memra builds the config from the
header itself (memrad.engine.model.preflight.gguf_config, its gpt-oss fields included), the
tokenizer with transformers' GGUF tokenizer reader (which needs no config), and fills every
parameter from the file's tensors, dequantised with gguf-py (MXFP4 included) as llama.cpp's
converter laid them out:

    llama.cpp (numpy shape)                       transformers' GptOssForCausalLM
    token_embd / output / output_norm             embed_tokens / lm_head / norm
    blk.N.attn_norm, post_attention_norm          input_layernorm, post_attention_layernorm
    blk.N.attn_{q,k,v,output}.weight, .bias       self_attn.{q,k,v,o}_proj.weight, .bias
    blk.N.attn_sinks.weight [H]                   self_attn.sinks
    blk.N.ffn_gate_inp.weight, .bias              mlp.router.weight, .bias
    blk.N.ffn_gate_exps.weight [E, I, H]          mlp.experts.gate_up_proj [E, H, 2I], even columns (transposed)
    blk.N.ffn_up_exps.weight   [E, I, H]                                              odd columns
    blk.N.ffn_down_exps.weight [E, H, I]          mlp.experts.down_proj [E, I, H] (transposed)
    blk.N.ffn_{gate,up}_exps.bias [E, I]          mlp.experts.gate_up_proj_bias [E, 2I], even / odd
    blk.N.ffn_down_exps.bias [E, H]               mlp.experts.down_proj_bias

A file with a tensor this table does not name, a tensor of another shape, or a parameter no
tensor fills is refused (ModelUnavailable), so a layout memra does not know never loads as
half-initialised weights. The float32 model then goes through the same publish as every GGUF
(memrad.engine.model.pull.publish_converted: reload checked, block caches, marker).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memrad.engine.model.unavailable import ModelUnavailable

ARCHITECTURE = "gpt-oss"  # general.architecture as llama.cpp writes it
_ALL, _GATE, _UP = slice(None), slice(0, None, 2), slice(1, None, 2)  # columns of the last dim
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# llama.cpp's name after "blk.N." -> (layer N's parameter, the columns of its last dim it fills,
# whether llama.cpp stores it transposed: an expert's rows are its outputs)
_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", _ALL, False),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", _ALL, False),
    **{f"attn_{short}.{part}": (f"self_attn.{proj}_proj.{part}", _ALL, False)
       for short, proj in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for part in ("weight", "bias")},
    "attn_sinks.weight": ("self_attn.sinks", _ALL, False),
    "ffn_gate_inp.weight": ("mlp.router.weight", _ALL, False),
    "ffn_gate_inp.bias": ("mlp.router.bias", _ALL, False),
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", _GATE, True),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", _UP, True),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", _ALL, True),
    "ffn_gate_exps.bias": ("mlp.experts.gate_up_proj_bias", _GATE, False),
    "ffn_up_exps.bias": ("mlp.experts.gate_up_proj_bias", _UP, False),
    "ffn_down_exps.bias": ("mlp.experts.down_proj_bias", _ALL, False),
}
_BLOCK = re.compile(r"blk\.(?P<layer>\d+)\.(?P<rest>.+)")


def is_gpt_oss(architecture: str) -> bool:
    return architecture == ARCHITECTURE


def load(gguf_path: Path) -> tuple[Any, Any]:
    """(GptOssForCausalLM in float32 with the file's weights dequantised, its tokenizer)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from memrad.engine.model.gguf_header import read_header
    from memrad.engine.model.preflight import gguf_config

    config = gguf_config(read_header(gguf_path), gguf_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fill(model, GGUFReader(gguf_path).tensors, gguf_path)
    return model, tokenizer


def fill(model: Any, tensors: Any, source: Path) -> None:
    """Set every parameter of `model` from the GGUF `tensors` (gguf-py ReaderTensors); raises
    ModelUnavailable for a tensor the table does not place or a parameter left unfilled."""
    from gguf import quants

    params = dict(model.named_parameters())  # a tied head is the embedding's one parameter
    filled: dict[str, set[tuple]] = {}
    for tensor in tensors:
        name, columns, transposed = _place(tensor.name, source)
        if name == "lm_head.weight" and name not in params:
            raise ModelUnavailable(f"{source} ships output.weight but its config ties the head")
        value = torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        value = value.transpose(-1, -2) if transposed else value
        with torch.no_grad():
            target = params[name][..., columns]
            if tuple(target.shape) != tuple(value.shape):
                raise ModelUnavailable(f"{source}: {tensor.name} is {tuple(value.shape)} where {name} takes "
                                       f"{tuple(target.shape)}")
            params[name][..., columns] = value
        filled.setdefault(name, set()).add((columns.start, columns.step))
    whole = {(None, None)}, {(0, 2), (1, 2)}
    missing = sorted(name for name in params if filled.get(name) not in whole)
    if missing:
        raise ModelUnavailable(f"{source} fills no tensor for {', '.join(missing[:4])}"
                               + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))


def _place(gguf_name: str, source: Path) -> tuple[str, slice, bool]:
    """(parameter name, columns of its last dim, stored transposed) of the GGUF tensor `gguf_name`."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], _ALL, False
    block = _BLOCK.fullmatch(gguf_name)
    if block is None or block["rest"] not in _LAYER:
        raise ModelUnavailable(f"{source}: memra does not know where gpt-oss's {gguf_name} goes")
    name, columns, transposed = _LAYER[block["rest"]]
    return f"model.layers.{block['layer']}.{name}", columns, transposed
