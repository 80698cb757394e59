"""Which one-token step a model decodes with: Gemma 3's (memrad.engine.decode.gemma_step),
Qwen3-Next's (memrad.engine.decode.qwen3_next_step) or the llama-shaped one
(memrad.engine.decode.step). All are called alike; the decoder (memrad.engine.decode.decoder)
and the package (memrad.engine.decode.package) ask here."""

from __future__ import annotations

from typing import Any

from torch import nn

from memrad.engine.decode import gemma_step, qwen3_next_step
from memrad.engine.decode import step as llama_step


def support(model: nn.Module, context_len: int) -> str | None:
    """None if a step computes `model`'s decode, else why not (a log and /health reason)."""
    if gemma_step.is_gemma(model):
        return gemma_step.support(model, context_len)
    if qwen3_next_step.is_qwen3_next(model):
        return qwen3_next_step.support(model, context_len)
    return llama_step.support(model, context_len)


def new_step(model: nn.Module, max_positions: int) -> nn.Module:
    """The step for a model `support` accepts."""
    if gemma_step.is_gemma(model):
        return gemma_step.GemmaStep(model, max_positions)
    if qwen3_next_step.is_qwen3_next(model):
        return qwen3_next_step.Qwen3NextStep(model, max_positions)
    return llama_step.DecodeStep(model, max_positions)


def windows(step: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention, a slab of the context; or a
    recurrent layer, see `recurrent`)."""
    return [getattr(layer, "window", None) for layer in step.layers]


def recurrent(step: Any) -> list[bool]:
    """Which layers hand the step recurrent state (memrad.engine.state.recurrent) as their
    keys and values, not attention rows."""
    return [getattr(layer, "recurrent", False) for layer in step.layers]


def kv_shape(config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of the model's cache rows."""
    _, kv_heads, head_dim = llama_step.attention_shape(config)
    return kv_heads, head_dim
