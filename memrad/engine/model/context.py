"""The context memrad serves: the model's native length, or beyond it RoPE scaling.

Up to the model's native length (`max_position_embeddings` as shipped) the served context
only sizes the cache and the limit requests are checked against. Beyond it, positions the
model never saw must be mapped onto the ones it did: memrad sets transformers' rope
parameters on the config before the model is built, the way llama.cpp (`--rope-scaling
yarn`) and vLLM extend a model. YaRN where the model's rope is plain (`default`): it
interpolates the low frequencies, keeps the high ones, and scales cos/sin by its attention
factor, which transformers' rotary module folds into the tables every path reads (prefill,
the decode step's per-position table; memra's attention kernel sees positions only through
them). A model already under linear scaling gets its factor multiplied (linear stays
linear); any other rope type is refused beyond its length rather than guessed at.

Layered rope parameters (Gemma 3: one set per layer type) scale the full-attention layers
only: a sliding-window layer attends at most its window back, and rope depends only on the
distance, so its positions never leave the range it was trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memrad.engine.model.unavailable import ModelUnavailable

_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True, slots=True)
class ServedContext:
    """What memrad serves and how. `factor` is 1.0 when `scaling` is "native"."""

    num_tokens: int  # prompt + reply, the limit every request is checked against
    native_tokens: int  # the model's own length, as shipped
    scaling: str  # "native", "yarn" or "linear"
    factor: float

    def describe(self) -> str:
        """"native" or "yarn x4": /v1/models, /health, `memrad status`."""
        return "native" if self.scaling == "native" else f"{self.scaling} x{self.factor:g}"

    def reason(self) -> str:
        """What is served and why, in words (/health, `memrad status`)."""
        if self.scaling == "native":
            return f"{self.num_tokens:,} tokens, within the model's native {self.native_tokens:,}"
        return (f"{self.num_tokens:,} tokens: {self.scaling} RoPE scaling x{self.factor:g} over the native "
                f"{self.native_tokens:,} (positions past it are interpolated; quality degrades gently "
                "with the factor)")


def native_tokens(config: Any) -> int:
    """The model's context length as its config states it."""
    text = config.get_text_config()
    for name in _LENGTH_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelUnavailable("the model config names no context length (max_position_embeddings)")


def plan(config: Any, requested: int, default: int | None = None) -> ServedContext:
    """The context to serve: `requested` (0: `default`, a catalog row's, else native)."""
    native = native_tokens(config)
    served = requested or default or native
    if served <= native:
        return ServedContext(served, native, "native", 1.0)
    rope = _scaled_params(config.get_text_config())
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return ServedContext(served, native, "yarn", served / native)
    if kind == "linear":
        return ServedContext(served, native, "linear", served / native)
    raise ModelUnavailable(
        f"the model's rope is {kind!r}, which memrad does not extend: serve at most its native "
        f"{native} tokens (--context {native} or less)")


def apply(config: Any, served: ServedContext) -> None:
    """Set the rope parameters and length for `served` on `config`, before the model is built
    (mutates `config`). Native contexts leave the rope as shipped."""
    if served.scaling == "native":
        return
    text = config.get_text_config()
    rope = _scaled_params(text)
    if served.scaling == "yarn":
        rope.update(rope_type="yarn", factor=served.factor, original_max_position_embeddings=served.native_tokens)
    else:
        rope.update(factor=float(rope.get("factor", 1.0)) * served.factor)
    for name in _LENGTH_FIELDS:
        if isinstance(getattr(text, name, None), int):
            setattr(text, name, served.num_tokens)
            break


def rope_key(config: Any) -> str:
    """The rope parameters as canonical JSON: the disk tier's key (state primed under one
    scaling is never resumed under another)."""
    return json.dumps(getattr(config.get_text_config(), "rope_parameters", None), sort_keys=True)


def _scaled_params(text: Any) -> dict:
    """The rope parameters to scale (mutable, inside `text`): the flat dict, or the
    full-attention layers' in a layered one."""
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        raise ModelUnavailable("the model config has no rope parameters: memrad cannot extend its context")
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        return rope["full_attention"]
    return rope
