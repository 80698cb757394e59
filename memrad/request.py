"""What a request asks of the engine, and what it gets back. Pure records, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memrad.protocol import Decision

# Where a request's conversation name came from (docs/SERVING.md: identity precedence).
IdentitySource = Literal["session_id", "prompt_cache_key", "user", "metadata.user_id", "previous_response_id",
                         "x-session-id"]
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class Identity:
    """The conversation a request claims to continue, and which field named it."""

    name: str
    source: IdentitySource


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()

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

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
