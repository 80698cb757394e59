"""RoPE per conversation: native where the conversation fits the model's window, scaled past it.

A model served past its native length (memrad.engine.model.context) is built with the
scaled rope parameters (YaRN x4 for the default model), and YaRN interpolates every position,
short prompts included: at 32k the default model answers "What is the capital of France?"
in French gibberish where `--context 8192` answers right. So each request runs under one of
two ropes, chosen once at admission from what is known then:

    prompt tokens + reply budget <= native   -> "native": the rope as shipped
    otherwise                                -> the served scaling ("yarn x4"), from token 0

The reply budget is the request's max_tokens as the server fitted it (lowered to
`limits.max_reply_tokens`, 4,096 by default, which a request naming none gets too), so a reply
never runs past the native window under the native rope. A conversation that grows past the
window is re-prefilled under the scaling once (its parked native state is declined:
memrad.reuse.planner); parked state records the rope it was computed under and is never
resumed under the other.

    prefill, transformers' decode   model.model.rotary_emb is a RopeSwitch: the served rotary
                                    module, or the native one inside `under("native")`, per
                                    thread (the engine thread prefills; a background check's
                                    prefill keeps the served rope)
    the decode step                 its cos/sin tables are the served rope's; native requests
                                    decode on a twin sharing every weight, with the native
                                    tables (memrad.engine.decode.native)
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from memrad.engine.model.context import ServedContext, rope_key

NATIVE = "native"


@dataclass(frozen=True, slots=True)
class Scaling:
    """The rope one request runs under, from its first token to its last, and why."""

    name: str  # "native", or the served scaling ("yarn x4")
    reason: str  # e.g. "8,301 tokens (prompt 4,205 + reply 4,096) > native 8,192"

    @property
    def native(self) -> bool:
        return self.name == NATIVE


class RopeSwitch(nn.Module):
    """The model's rotary module, with the native one beside it: `under(name)` picks which the
    forwards on this thread read. Attributes the rest of memrad reads (rope_type,
    attention_scaling, ...) are the served module's."""

    def __init__(self, served: nn.Module, native: nn.Module, served_name: str) -> None:
        super().__init__()
        self.served, self.native = served, native
        self.served_name = served_name
        self._local = threading.local()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.native if getattr(self._local, "name", None) == NATIVE else self.served)(*args, **kwargs)

    @contextmanager
    def under(self, name: str | None) -> Iterator[None]:
        """Forwards on this thread read the rope `name` ("native" or the served one; None:
        the served one) until the block ends."""
        before = getattr(self._local, "name", None)
        self._local.name = name
        try:
            yield
        finally:
            self._local.name = before

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("served"), name)


def install(model: Any, native_config: Any, served: ServedContext) -> RopeSwitch | None:
    """Put a RopeSwitch in place of `model.model.rotary_emb` where the model is served past its
    native length and its rotary module can be built for the shipped rope (mutates `model`);
    None where it is served natively or cannot (then every request runs scaled)."""
    body = getattr(model, "model", None)
    rotary = getattr(body, "rotary_emb", None)
    if served.scaling == NATIVE or not isinstance(rotary, nn.Module):
        return None
    try:
        native = type(rotary)(native_config.get_text_config())
    except Exception:  # another constructor: this model runs scaled from the first token
        return None
    param = next(model.parameters())
    switch = RopeSwitch(rotary, native.to(param.device), served.describe())
    body.rotary_emb = switch
    return switch


def native_copy(config: Any) -> Any:
    """The config as shipped, before memrad.engine.model.context.apply scales it."""
    return copy.deepcopy(config)


def keys(served: ServedContext, served_config: Any, native_config: Any | None) -> dict[str, str]:
    """{scaling name: its rope parameters as canonical JSON}: what the disk tier records in a
    session file and matches on load (memrad.engine.state.disk)."""
    found = {served.describe(): rope_key(served_config)}
    if native_config is not None:
        found[NATIVE] = rope_key(native_config)
    return found


@dataclass(frozen=True, slots=True)
class RopeRule:
    """Which rope a request runs under. `per_conversation` False: always the served one
    (`why` says why: served natively, or a decode step with one table)."""

    context: ServedContext
    per_conversation: bool
    why: str = ""

    def choose(self, prompt_tokens: int, reply_tokens: int) -> Scaling:
        """The rope for a request of `prompt_tokens` whose reply may run `reply_tokens`."""
        served, native = self.context.describe(), self.context.native_tokens
        if not self.per_conversation:
            return Scaling(served, self.why)
        total = prompt_tokens + reply_tokens
        numbers = f"{total:,} tokens (prompt {prompt_tokens:,} + reply {reply_tokens:,})"
        if total <= native:
            return Scaling(NATIVE, f"{numbers} fit the native {native:,}")
        return Scaling(served, f"{numbers} > native {native:,}")

    def describe(self) -> str:
        """/health's and `memrad status`'s value, e.g. "native to 8,192, yarn x4 to 32,768"."""
        if not self.per_conversation:
            return self.context.describe()
        return f"native to {self.context.native_tokens:,}, {self.context.describe()} to {self.context.num_tokens:,}"

    def reason(self) -> str:
        """The rule in words (/health, `memrad status`, /v1/models' `context_rule`)."""
        if not self.per_conversation:
            return self.context.reason() + (f"; {self.why}" if self.context.scaling != NATIVE else "")
        c = self.context
        return (f"{c.num_tokens:,} tokens served: a request whose prompt + max_tokens fits the native "
                f"{c.native_tokens:,} runs at the model's native RoPE; one that needs more runs under "
                f"{c.describe()} from its first token, and a conversation that grows past the native length "
                f"is re-prefilled under {c.describe()} once (parked state is never resumed under another rope)")


def rule_for(context: ServedContext, switch: RopeSwitch | None, native_steps: bool, step_why: str) -> RopeRule:
    """The rule an engine serves by: per conversation where the model has both ropes (`switch`)
    and its decode step can run the native one (`native_steps`; `step_why` says why not)."""
    if context.scaling == NATIVE:
        return RopeRule(context, False, "served within the native length")
    if switch is None:
        return RopeRule(context, False, "every request runs scaled: memrad cannot build this model's native "
                                        "rotary module beside the scaled one")
    if not native_steps:
        return RopeRule(context, False, f"every request runs scaled: {step_why}")
    return RopeRule(context, True)
