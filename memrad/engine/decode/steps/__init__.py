"""Which one-token step a model decodes with: one module per architecture, all called alike.

    llama.py       the llama-shaped step (Llama, Mistral, Qwen2, Qwen3 dense, Phi-3, Qwen3-MoE), and
                   the parts the others share
    experts.py     the routed mixture-of-experts feed-forward (Qwen3-MoE) on it
    gemma.py       Gemma 3's (sliding-window layers beside full attention)
    gemma2.py      Gemma 2's (Gemma 3's layers with soft-capped attention scores, one rope)
    gemma4.py      Gemma 4's text decoder (Gemma 3's layers with per-layer inputs, KV-shared layers,
                   a head dim per layer kind)
    qwen3_next.py  Qwen3-Next's (gated delta net layers: gated_delta.py)
    falcon_h1.py   FalconH1's (Mamba-2 beside attention in every layer: mamba2.py)
    lfm2.py        LFM2's (gated short convolutions beside attention with per-head q/k norms)
    gpt_oss.py     gpt-oss's (sliding-window and full attention with sinks, routed experts)

The decoder (memrad.engine.decode.decoder) and the package (memrad.engine.decode.package) ask here."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn

from memrad.engine.decode.steps import experts as routed
from memrad.engine.decode.steps import falcon_h1, gemma, gemma2, gemma4, gpt_oss, lfm2, llama, qwen3_next
from memrad.engine.model.hardware import Choice

# What each layer kind of transformers' `layer_types` is on the step, for `describe`.
_KIND_NAMES = {"full_attention": "full-attention", "sliding_attention": "sliding-window",
               "linear_attention": "gated delta net (conv and recurrent state rewritten in place)",
               "conv": "short convolution (conv state rewritten in place)"}


# What `describe` names each step by (every other llama-shaped class: "llama").
_STEP_NAMES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3-moe", "Phi3ForCausalLM": "phi3",
               "Gemma2ForCausalLM": "gemma2", "Gemma4ForCausalLM": "gemma4",
               "Gemma3ForCausalLM": "gemma3", "Qwen3NextForCausalLM": "qwen3-next", "Lfm2ForCausalLM": "lfm2",
               "GptOssForCausalLM": "gpt-oss"}


def covered() -> tuple[str, ...]:
    """The model classes some step covers."""
    return (*llama._LLAMA_SHAPED, *gemma2._GEMMA2, *gemma._GEMMA, *gemma4._GEMMA4, *qwen3_next._QWEN3_NEXT,
            *falcon_h1._FALCON_H1, *lfm2._LFM2, *gpt_oss._GPT_OSS)


# The steps beside the llama-shaped one: (is it this architecture, why not, its step class).
_OTHER_STEPS = (
    (gemma.is_gemma, gemma.support, gemma.GemmaStep),
    (gemma2.is_gemma2, gemma2.support, gemma2.Gemma2Step),
    (gemma4.is_gemma4, gemma4.support, gemma4.Gemma4Step),
    (qwen3_next.is_qwen3_next, qwen3_next.support, qwen3_next.Qwen3NextStep),
    (falcon_h1.is_falcon_h1, falcon_h1.support, falcon_h1.FalconH1Step),
    (lfm2.is_lfm2, lfm2.support, lfm2.Lfm2Step),
    (gpt_oss.is_gpt_oss, gpt_oss.support, gpt_oss.GptOssStep),
)


def _other_step(model: nn.Module) -> tuple | None:
    return next((entry for entry in _OTHER_STEPS if entry[0](model)), None)


def support(model: nn.Module, context_len: int) -> str | None:
    """None if a step computes `model`'s decode, else why not (a log and /health reason)."""
    other = _other_step(model)
    if other is not None:
        return other[1](model, context_len)
    name = type(model).__name__
    if name not in llama._LLAMA_SHAPED:
        return f"{name} has no decode step (the steps cover {', '.join(covered())})"
    return llama.support(model, context_len)


def describe(model: nn.Module, context_len: int) -> Choice:
    """Which step decodes `model` and what its layers are on it (/health, `memrad status`):
    value "llama", "qwen3", "qwen3-moe", "phi3", "gemma2", "gemma3", "gemma4", "gemma4-moe", "qwen3-next",
    "falcon-h1", "lfm2", "gpt-oss", or "none" with the reason it has none."""
    why_not = support(model, context_len)
    if why_not is not None:
        return Choice("none", why_not)
    config = model.config
    if falcon_h1.is_falcon_h1(model):
        return Choice("falcon-h1", f"{type(model).__name__} layers on one graph: {config.num_hidden_layers} Mamba-2 "
                                   "beside full attention (conv and SSM state rewritten in place)")
    value = _STEP_NAMES.get(type(model).__name__, "llama")
    if getattr(config, "enable_moe_block", False):  # Gemma 4's mixture (26B-A4B): the same class and step
        value = "gemma4-moe"
    kinds = Counter(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    layers = ", ".join(f"{count} {_KIND_NAMES.get(kind, kind)}" for kind, count in kinds.items())
    experts = getattr(config, "num_experts", 0) or 0  # gpt-oss's num_local_experts too (its attribute map)
    moe = f"; experts: top {routed.top_k(config)} of {experts} per token" if experts else ""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0  # Gemma 4
    sharing = f"; the last {shared} attend earlier layers' KV" if shared else ""
    return Choice(value, f"{type(model).__name__} layers on one graph: {layers}{moe}{sharing}")


def new_step(model: nn.Module, max_positions: int) -> nn.Module:
    """The step for a model `support` accepts."""
    other = _other_step(model)
    return (other[2] if other is not None else llama.DecodeStep)(model, max_positions)


def attends_on_kernel(model: nn.Module, context_len: int) -> str | None:
    """None where every attention layer of `model`'s step runs memra's decode kernel (given the
    kernel), so a bf16 cache under fp32 activations is read as it is (memrad.engine.model.kv_dtype):
    the llama-shaped step and Gemma 3's; else why not."""
    why_not = support(model, context_len)
    if why_not is not None:
        return why_not
    other = _other_step(model)
    if other is not None and other[2] is not gemma.GemmaStep:
        return f"{other[2].__name__} attends with torch, not memra's kernel"
    return None


def has_batched(step: Any) -> bool:
    """Whether `step` has a batched twin (memrad.engine.decode.batch): the llama-shaped step,
    LFM2's (its attention layers llama's, its conv state one tensor per request), Gemma 3's,
    Gemma 2's, Gemma 4's and gpt-oss's (each row over its own slabs and window views:
    `forward_rows`); the hybrids decode one row at a time."""
    return isinstance(step, (llama.DecodeStep, lfm2.Lfm2Step, gemma.GemmaStep, gemma2.Gemma2Step, gemma4.Gemma4Step,
                             gpt_oss.GptOssStep))


def windows(step: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention, a slab of the context; a recurrent
    layer, see `recurrent`; or a KV-shared one, see `slabs`)."""
    return [None if getattr(layer, "shared", False) else getattr(layer, "window", None) for layer in step.layers]


def slabs(step: Any) -> list[int]:
    """The layers handed a slab of the context: neither a window, nor recurrent state, nor a
    KV-shared layer's empty pair (Gemma 4: memrad.engine.state.shared.SharedLayer)."""
    return [i for i, (layer, window, state) in enumerate(zip(step.layers, windows(step), recurrent(step)))
            if window is None and not state and not getattr(layer, "shared", False)]


def recurrent(step: Any) -> list[bool]:
    """Which layers hand the step recurrent state (memrad.engine.state.recurrent) as their
    keys and values, not plain attention rows (FalconH1's: a pair of slabs, a pair of states;
    LFM2's conv layers: their conv state and an empty tensor)."""
    return [getattr(layer, "recurrent", False) for layer in step.layers]


def kv_row_shapes(config: Any) -> list[tuple[int, int]]:
    """(KV heads, head dim) of each attention layer that keeps its own rows (preflight's KV bytes):
    Gemma 4's per layer kind, its KV-shared layers left out; every other's `kv_shape`."""
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    attention = [i for i, kind in enumerate(kinds) if kind in ("full_attention", "sliding_attention")]
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        return [kv_shape(config)] * len(attention)
    layers = config.per_layer_config
    return [(layers[i].num_key_value_heads, layers[i].head_dim) for i in attention if modes[i] != "reuse"]


def kv_shape(config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of the model's cache rows."""
    _, kv_heads, head_dim = llama.attention_shape(config)
    return kv_heads, head_dim
