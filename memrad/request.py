"""What a request asks of the engine, and what it gets back. Pure records, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memrad.protocol import Decision, Speculation

# Where a request's conversation name came from (docs/SERVING.md: identity precedence).
IdentitySource = Literal["session_id", "prompt_cache_key", "user", "metadata.user_id", "previous_response_id",
                         "x-session-id"]
# "grammar": the reply's grammar could not continue (llguidance hit a limit): never a "stop"
FinishReason = Literal["stop", "length", "cancelled", "grammar"]


@dataclass(frozen=True, slots=True)
class Identity:
    """The conversation a request claims to continue, and which field named it."""

    name: str
    source: IdentitySource


ConstraintKind = Literal["json_object", "json_schema", "tool_call"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar the reply must match, built by memrad.chat.grammar: llguidance's lark text,
    what it constrains, and the request field it came from (a grammar that does not compile
    is a 400 naming that field)."""

    grammar: str
    kind: ConstraintKind
    param: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen (memrad.engine.sampling; docs/SERVING.md, sampling).

    Penalties follow OpenAI (frequency / presence: over the generated tokens) and vLLM
    (repetition: over prompt and generated tokens, dividing positive logits); `logit_bias`
    is (token id, bias) pairs; top_k 0 and min_p 0 are off; `constraint`: the grammar the reply
    must match (structured outputs, forced tool calls), applied as a mask after all of these.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None
    logprobs: int | None = None  # None: none returned; k: each token's and its k likeliest alternatives'

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated, tokenized request: everything the engine and the reuse tiers need."""

    request_id: str
    model: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
    sampling: SamplingParams
    identity: Identity | None = None
    cache_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability under the distribution it was sampled from (after
    penalties, bias and the grammar's mask, before temperature), with its exact bytes, and
    the likeliest alternatives at that step (`top`, each with `top` empty)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    """The outcome of one generation; `text` is exactly what the client was sent."""

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    total_s: float
    decision: Decision | None = None  # what the reuse tiers decided (None: not planned)
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, when the request asked
    error: str | None = None  # why the reply could not go on (finish_reason "grammar")
    speculation: Speculation | None = None  # drafts verified while decoding (memrad.engine.speculation)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
