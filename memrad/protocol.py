"""Records shared by the daemon and its clients (log, API debug field, TUI). Stdlib only.

A decision is one record rendered by one function, so the log line, the response header
and the TUI row say the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["resumed", "declined", "cold"]
Tier = Literal["token-prefix", "text-prefix"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the reuse tiers decided for one request, and why.

    `tier` is the tier that nominated a parked session (None: nothing was nominated);
    `checkpoint` is the position resumed from (None unless resumed); `reused_tokens` +
    `primed_tokens` always equal the prompt length.
    """

    request_id: str
    outcome: Outcome
    reason: str
    reused_tokens: int
    primed_tokens: int
    tier: Tier | None = None
    candidate: str | None = None
    checkpoint: int | None = None

    def render(self) -> str:
        head = f"{self.tier}: {self.outcome}" if self.tier else self.outcome
        return f"{head} ({self.reason})"
