"""Which attention a model's prefill runs: memra's kernel where it applies, else torch's SDPA.

memra's kernel (memrad.engine.kernels.prefill_attention) is installed behind transformers'
attention interface, and each call goes to it or to SDPA:

    model forward -> each attention layer -> attend(module, q [1, H_q, T, D], keys, values [1, H_kv, L, D])
        T > 1, bf16 or fp32, plain causal layer -> memra::prefill_attention -> out [1, T, H_q, D]
        anything else (one token, sliding window, soft-capping, fp16, ...) -> transformers' SDPA

Which one a model runs is decided once, when it is loaded (`install`, from
memrad.engine.model.loader), and never changes: resumed == cold is a promise per configuration,
and a parked state primed under one attention must not be resumed under the other (the disk
tier's key names it). `auto` picks the kernel wherever memra's kernels are built for AVX2 or
AVX512 and the activations are bf16 or fp32: each of its paths (AMX tiles, AVX512-BF16 pair dots,
fp32 FMA tiles on AVX512 or AVX2, bf16 widened to fp32 on AVX2) was measured faster than torch's
SDPA at every cache length from 2k to 16k (docs/BENCHMARKS.md#the-prefill-attention-kernel), so
nothing is timed at load; a path not measured (bf16 widened on AVX512) keeps SDPA. auto still
declines the two bf16 vector paths (`_AUTO_DECLINES`: as accurate as SDPA, but the bf16 logits tie
a near-tied answer the other way); `memra` runs the kernel on any path it has. Elsewhere (CUDA,
fp16, a CPU below AVX2) torch's attention runs, and the reason says why.
"""

from __future__ import annotations

import torch

from memrad.engine.kernels import prefill_attention as kernel
from memrad.engine.kernels.build import capability
from memrad.engine.model.hardware import Choice

NAME = "memra_prefill"  # the attention implementation's name in transformers' registry
MODES = ("auto", "memra", "torch")
_DTYPES = (torch.bfloat16, torch.float32)  # what the kernel multiplies


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
    return (query.shape[2] > 1 and query.shape[0] == 1 and query.dtype in _DTYPES
            and key.dtype == query.dtype and query.device.type == "cpu" and dropout == 0.0
            and key.shape[2] >= query.shape[2] and getattr(module, "is_causal", True)
            and getattr(module, "sliding_window", None) is None and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and query.shape[-1] % 32 == 0)


def install(model, mode: str = "auto") -> Choice:
    """Route `model`'s attention through memra's kernel where auto takes it (`auto`), or on any
    path the kernel has here (`memra`: for A/B runs and the tests of the paths auto declines),
    or leave torch's SDPA (`torch`, or where the kernel cannot run: the reason says why). Mutates
    the model's config. A model keeps its first choice: installing another one later raises."""
    if mode not in MODES:
        raise ValueError(f"prefill attention must be one of {', '.join(MODES)}, got {mode!r}")
    made = getattr(model, "_memra_prefill_attention", None)
    if made is not None:
        if made[0] != mode:
            raise ValueError(f"this model's prefill attention was set to {made[0]!r}; load it again for {mode!r}")
        return made[1]
    said = "auto" if mode == "auto" else "set by engine.prefill_attention"
    why_not = said if mode == "torch" else _why_not(model, mode)
    if why_not is None:
        _register()
        model.config._attn_implementation = NAME
        choice = Choice("memra", f"{said}: memra's prefill kernel, {_PATHS[kernel.path(model.dtype)]}")
    else:
        choice = Choice("torch", why_not if mode == "torch" else f"{said}: {why_not}")
    model._memra_prefill_attention = (mode, choice)
    return choice


def _head_dims(config) -> list[int]:
    """Every layer's head dim: a heterogeneous config (Gemma 4's per_layer_config) has one a layer
    and refuses a global `head_dim`."""
    layers = getattr(config, "per_layer_config", None)
    per_layer = ([getattr(layers[layer], "head_dim", None) for layer in range(config.num_hidden_layers)] if layers
                 else [getattr(config, "head_dim", None)])
    return [dim or config.hidden_size // config.num_attention_heads for dim in per_layer]


# The kernel's paths (kernel.path) -> what was measured: each faster than SDPA on the op alone (a
# 256-token chunk of the default model's heads over 2k-16k cached rows, one thread; AMX's at
# 8k-32k). A path not listed (bf16 widened on AVX512 without AVX512-BF16) keeps SDPA.
_PATHS = {
    "amx": "AMX tiles (bf16; 1.1-1.8x torch's SDPA at 8k-32k on a Xeon)",
    "avx512-bf16": "AVX512-BF16 pair dots (bf16; 4.4-5.1x torch's SDPA at 2k-16k on Zen 5)",
    "avx512 fp32": "fp32 FMA on AVX512 (2.1-2.2x torch's SDPA at 2k-16k on Zen 5)",
    "avx2 fp32": "fp32 FMA on AVX2 (1.3x torch's SDPA at 2k-16k, forced AVX2 on Zen 5)",
    "avx2 fp32 (bf16 widened)": "bf16 widened to fp32 FMA on AVX2 (1.3-1.4x torch's SDPA at 2k-16k, forced AVX2 "
                                "on Zen 5)",
}


# The paths auto declines though they win, and why. Their bf16 output is as close to float64 as
# SDPA's (the default model's France prompt, every layer: worst 0.0166 both, rms 5.5e-4 both), but
# the logits are bf16 (ulp 0.125 at 25), so a first token whose float64 lead is 0.08 ties there
# ("The" 25.5 / "L" 25.5; SDPA's 25.75 / 25.5), and argmax takes the wrong one ("L'Étoile, ...":
# docs/BENCHMARKS.md#the-prefill-attention-kernel). AMX kept auto's choice from before.
_AUTO_DECLINES = {
    "avx512-bf16": "torch's SDPA: memra's kernel would run AVX512-BF16 pair dots here, whose bf16 rounding "
                   "flips the default model's near-tied answers (engine.prefill_attention = memra runs it)",
    "avx2 fp32 (bf16 widened)": "torch's SDPA: memra's kernel would widen bf16 to fp32 here, whose bf16 rounding "
                                "flips the default model's near-tied answers (engine.prefill_attention = memra "
                                "runs it)",
}


def _why_not(model, mode: str) -> str | None:
    """Why memra's kernel does not serve this model here under `mode` (auto, memra), or None."""
    config = model.config
    if model.device.type != "cpu":
        return f"torch's attention on {model.device.type}"
    if model.dtype not in _DTYPES:
        return f"the activations are {str(model.dtype).removeprefix('torch.')} (the kernel multiplies bf16 or fp32)"
    if capability() not in ("AVX512", "AVX2"):
        return f"the CPU kernels are {capability()} (memra's prefill kernel runs on AVX2 or AVX512)"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", NAME):
        return f"the model was loaded with {config._attn_implementation} attention"
    head_dim = next((dim for dim in _head_dims(config) if dim % 32), None)
    if head_dim is not None:
        return f"head dim {head_dim} is not a multiple of 32"
    why_not = kernel.load()
    if why_not is not None:
        return why_not
    path = kernel.path(model.dtype)
    if path not in _PATHS:
        return f"memra's prefill kernel would run {path} here, not measured against torch's SDPA"
    return _AUTO_DECLINES.get(path) if mode == "auto" else None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    # SDPA's masks: the layers the kernel passes back to SDPA (one token, sliding windows) read them.
    AttentionInterface.register(NAME, attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
