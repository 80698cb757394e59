"""Which attention a model's prefill runs: memra's AMX kernel where it applies, else torch's SDPA.

memra's kernel (memrad.engine.kernels.prefill_attention) is installed behind transformers'
attention interface, and each call goes to it or to SDPA:

    model forward -> each attention layer -> attend(module, q [1, H_q, T, D], keys, values [1, H_kv, L, D])
        T > 1, bf16, plain causal layer   -> memra::prefill_attention -> out [1, T, H_q, D]
        anything else (one token, sliding window, soft-capping, fp32, ...) -> transformers' SDPA

Which one a model runs is decided once, when it is loaded (`install`, from
memrad.engine.model.loader), and never changes: resumed == cold is a promise per configuration,
and a parked state primed under one attention must not be resumed under the other (the disk
tier's key names it). `auto` picks the kernel where the CPU has AMX and the activations are
bf16; everywhere else (AVX2-only or AVX512 CPUs without AMX, fp32, CUDA) torch's attention
runs, and the reason says why.
"""

from __future__ import annotations

import torch

from memrad.engine.kernels import prefill_attention as kernel
from memrad.engine.model.hardware import Choice, native_bf16

NAME = "memra_prefill"  # the attention implementation's name in transformers' registry
MODES = ("auto", "torch")


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float = 0.0,
           scaling: float | None = None, **kwargs):
    """transformers' attention-function signature; (out [1, T, H_q, D], None)."""
    if _kernel_applies(module, query, key, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.memra.prefill_attention(query, key, value, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _kernel_applies(module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs) -> bool:
    # The kernel's mask is implicit: query t attends rows 0 .. L - T + t. That is the mask
    # transformers builds for one unpadded sequence over a cache on a plain causal layer (memra
    # never pads), and nothing else: a window, soft-capping or a position bias goes to SDPA.
    return (query.shape[2] > 1 and query.shape[0] == 1 and query.dtype == torch.bfloat16
            and key.dtype == torch.bfloat16 and query.device.type == "cpu" and dropout == 0.0
            and key.shape[2] >= query.shape[2] and getattr(module, "is_causal", True)
            and getattr(module, "sliding_window", None) is None and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and query.shape[-1] % 32 == 0)


def install(model, mode: str = "auto") -> Choice:
    """Route `model`'s attention through memra's kernel where it applies (`auto`), or leave
    torch's SDPA (`torch`, or where the kernel cannot run: the reason says why). Mutates the
    model's config. A model keeps its first choice: installing the other one later raises."""
    if mode not in MODES:
        raise ValueError(f"prefill attention must be one of {', '.join(MODES)}, got {mode!r}")
    made = getattr(model, "_memra_prefill_attention", None)
    if made is not None:
        if made[0] != mode:
            raise ValueError(f"this model's prefill attention was set to {made[0]!r}; load it again for {mode!r}")
        return made[1]
    why_not = "set by engine.prefill_attention" if mode == "torch" else _why_not(model)
    if why_not is None:
        _register()
        model.config._attn_implementation = NAME
        choice = Choice("memra", "auto: the CPU has AMX and the activations are bf16 (memra's prefill kernel)")
    else:
        choice = Choice("torch", why_not if mode == "torch" else f"auto: {why_not}")
    model._memra_prefill_attention = (mode, choice)
    return choice


def _head_dims(config) -> list[int]:
    """Every layer's head dim: a heterogeneous config (Gemma 4's per_layer_config) has one a layer
    and refuses a global `head_dim`."""
    layers = getattr(config, "per_layer_config", None)
    per_layer = ([getattr(layers[layer], "head_dim", None) for layer in range(config.num_hidden_layers)] if layers
                 else [getattr(config, "head_dim", None)])
    return [dim or config.hidden_size // config.num_attention_heads for dim in per_layer]


def _why_not(model) -> str | None:
    """Why memra's kernel cannot serve this model here, or None."""
    config = model.config
    if model.device.type != "cpu":
        return f"torch's attention on {model.device.type}"
    if model.dtype != torch.bfloat16:
        return f"the activations are {str(model.dtype).removeprefix('torch.')} (the kernel multiplies bf16)"
    if not kernel.has_amx():
        return "the CPU has no AMX tiles (the kernel multiplies on them)"
    bf16 = native_bf16()
    if bf16.value != "yes":
        return bf16.reason
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", NAME):
        return f"the model was loaded with {config._attn_implementation} attention"
    head_dim = next((dim for dim in _head_dims(config) if dim % 32), None)
    if head_dim is not None:
        return f"head dim {head_dim} is not a multiple of 32"
    return kernel.load()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    # SDPA's masks: the layers the kernel passes back to SDPA (one token, sliding windows) read them.
    AttentionInterface.register(NAME, attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
