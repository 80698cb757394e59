"""Records shared by the daemon and its clients (log, API debug field, TUI). Stdlib only.

A decision is one record rendered by one function, so the log line, the response header
and the TUI row say the same words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, is_dataclass
from typing import Literal

Outcome = Literal["resumed", "declined", "cold"]
Tier = Literal["token-prefix", "text-prefix", "affinity", "prefix", "live"]  # live: memrad.reuse.attach
REASON_CLASSES = ("nothing-parked", "no-prefix", "no-control-tokens", "below-bar", "named-vs-unnamed",
                  "no-such-name", "diverged", "no-suffix", "no-checkpoint", "rescaled")


@dataclass(frozen=True, slots=True)
class Alternative:
    """One candidate the planner weighed: the tier that offered it, the tokens it would
    reuse at an exact checkpoint (None: verification declined it) and what resuming it would
    cost, in tokens (memrad.reuse.cost; None: declined)."""

    tier: Tier
    candidate: str
    reused_tokens: int | None
    cost_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What the reuse tiers decided for one request, and why.

    `tier` is the tier that nominated a parked session (None: nothing was nominated);
    `nomination` is how affinity nominated it (explicit by name, or implicit by
    fingerprint) and `source` the field that carried the name; `checkpoint` is the position
    resumed from (None unless resumed); `divergence` is the first position where the
    prompt's tokens differ from the candidate's (None when they never do);
    `reused_tokens` + `primed_tokens` always equal the prompt length; `reason_class` names
    why nothing was reused (None when resumed): one of REASON_CLASSES, for counting.
    `weighed` lists every candidate the tiers offered (the winner among them) and `won_by`
    says why the winner won ("most reuse", "cheaper resume", "tie: own conversation", "tie:
    most recent"); both are empty when at most one distinct session was offered. `step` is the
    decode step the request decodes with from its first token to its last ("compiled", "eager"
    or "transformers"; None until the engine has chosen it, and from engines that do not say).
    `rope` is the RoPE the request runs under from its first token to its last: "native", or
    the served scaling ("yarn x4") where its prompt + reply does not fit the native length
    (memrad.engine.model.rope; None from engines that do not say). A parked state computed
    under another rope is never resumed: reason class "rescaled".

    What the resume cost: `cost_tokens` is the planner's price of it in tokens
    (memrad.reuse.cost), `copied_rows` the rows a fork copies first (None: nothing copied);
    the engine adds, once the state is checked out, `copied_bytes` (what that copy moved)
    and `checkout_s` (loading, rebuilding and copying the state: the time before priming).
    `render_cost` says it in words, the same in the log, the API's `memra` field and the TUI.
    """

    request_id: str
    outcome: Outcome
    reason: str
    reused_tokens: int
    primed_tokens: int
    tier: Tier | None = None
    candidate: str | None = None
    checkpoint: int | None = None
    nomination: Literal["explicit", "implicit"] | None = None
    source: str | None = None
    shared_segments: int | None = None
    divergence: int | None = None
    ttft_s: float | None = None
    reason_class: str | None = None
    weighed: tuple[Alternative, ...] = ()
    won_by: str | None = None
    step: str | None = None
    cost_tokens: int | None = None
    copied_rows: int | None = None
    copied_bytes: int | None = None
    checkout_s: float | None = None
    rope: str | None = None

    def render(self) -> str:
        head = f"{self.tier}: {self.outcome}" if self.tier else self.outcome
        return f"{head} ({self.reason})"

    def render_cost(self) -> str:
        """What the resume cost, e.g. "cost: primed 232 tokens, copied 1,442 rows (31.7 MiB),
        state ready in 35.4 ms; priced 290 tokens"."""
        parts = [f"primed {self.primed_tokens:,} tokens"]
        if self.copied_rows is not None:
            moved = "" if self.copied_bytes is None else f" ({self.copied_bytes / 2**20:.1f} MiB)"
            parts.append(f"copied {self.copied_rows:,} rows{moved}")
        elif self.outcome == "resumed":
            parts.append("nothing copied")
        if self.checkout_s is not None:
            parts.append(f"state ready in {self.checkout_s * 1e3:.1f} ms")
        price = "" if self.cost_tokens is None else f"; priced {self.cost_tokens:,} tokens"
        return "cost: " + ", ".join(parts) + price


@dataclass(frozen=True, slots=True)
class Speculation:
    """How one reply decoded with drafts from its context (memrad.engine.speculation).

    `on` False: no draft was verified, and `reason` says why (the setting, the decode step, the
    model). `drafted_tokens` were offered in `verify_steps` multi-row steps and
    `accepted_tokens` of them kept; `decode_steps` counts every decode step the reply ran
    (verify steps and plain one-token steps), `fed_tokens` the tokens those steps fed, so
    `tokens_per_step` is 1.0 for plain decoding."""

    on: bool
    reason: str
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    decode_steps: int = 0
    fed_tokens: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.fed_tokens / self.decode_steps if self.decode_steps else None

    def render(self) -> str:
        if not self.on:
            return f"speculation: off ({self.reason})"
        figures = (f"accepted {self.accepted_tokens} of {self.drafted_tokens} drafted"
                   + (f" ({self.acceptance:.0%})" if self.drafted_tokens else "")
                   + f" in {self.verify_steps} verify steps; {self.tokens_per_step or 0:.2f} tokens per step")
        return f"speculation: on ({self.reason}; {figures})"


# --- the control socket's records (memra-tui reads these; see docs/TUI.md) -----------------


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One message of a fingerprint chain: its token span, a short label, its edge hash."""

    label: str  # the segment's first tokens, e.g. "<|im_start|>user"
    start: int
    end: int
    hash: str   # xxh64, hex


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    identity: str | None
    identity_source: str | None
    model: str
    cache_salt: str | None
    num_tokens: int
    prompt_checkpoint: int
    exact_limit: int
    checkpoints: tuple[int, ...]
    num_bytes: int
    age_s: float
    hits: int
    segments: tuple[SegmentInfo, ...]
    on_disk: bool = False  # in the disk tier: survives a restart, loaded when chosen


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The reuse pools' figures at one moment (/metrics and the control snapshot read it):
    the memory pool, then the disk tier. A tier that is off counts zeros."""

    sessions: int
    bytes_parked: int
    max_sessions: int
    max_bytes: int
    disk_sessions: int = 0
    disk_bytes: int = 0


@dataclass(frozen=True, slots=True)
class FlightInfo:
    """A request on the model now (max_batch of them at most): which conversation it
    continues, whether it is still priming its prompt or decoding, and how far it got."""

    request_id: str
    identity: str | None
    conversation: str | None  # the parked session it resumes or forks (None: a cold start)
    phase: Literal["prefill", "decode", "done"]
    prompt_tokens: int
    primed_tokens: int  # of the prompt, reused or prefilled so far
    generated_tokens: int
    age_s: float  # since it was admitted to the model
    step: str | None = None  # the decode step it decodes with, first token to last


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """The answer to `{"op": "snapshot"}`: every parked session, stats, flags in force."""

    model: str
    device: str
    uptime_s: float
    requests_served: int
    pool: PoolStats  # zeros when MEMRA_REUSE_POOL=0 (the flags say pool = false)
    flags: tuple[tuple[str, str], ...]  # (name, value): mode, affinity, prefill_chunk, ...
    sessions: tuple[SessionInfo, ...]
    dropped: int = 0  # events this connection lost while subscribed (always 0 here)
    flights: tuple[FlightInfo, ...] = ()  # the requests on the model now, in admission order


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """A request's decision, with the request's own chain for comparing with a session's."""

    at: float
    decision: Decision
    prompt_tokens: int
    identity: str | None
    segments: tuple[SegmentInfo, ...]
    # Tokens around the divergence, decoded: (request's text, candidate's text), if any.
    divergence_context: tuple[str, str] | None = None
    # The candidate's chain as it was when this request was compared with it.
    candidate_segments: tuple[SegmentInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class TurnEvent:
    """A finished request: what TTFT it had at which prompt length, in which conversation."""

    at: float
    request_id: str
    conversation: str | None  # the session it parked as (None: not parked)
    identity: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    outcome: str
    finish_reason: str
    total_s: float | None = None  # request start to the last token
    step: str | None = None  # the decode step its reply ran on: "compiled", "eager", "transformers"
    speculation: Speculation | None = None  # how the reply decoded with drafts (None: not recorded)


@dataclass(frozen=True, slots=True)
class FlightEvent:
    """A request on the model moved on: admitted, a prefill chunk, every few tokens, done."""

    at: float
    flight: FlightInfo


@dataclass(frozen=True, slots=True)
class ParkEvent:
    at: float
    session: SessionInfo
    replaced: str | None


@dataclass(frozen=True, slots=True)
class EvictEvent:
    at: float
    session_id: str
    num_tokens: int
    num_bytes: int
    spill_failed: str | None = None  # why its write to the disk tier failed; None: dropped by policy


@dataclass(frozen=True, slots=True)
class Dropped:
    """Sent to a subscriber that was too slow: this many events were dropped for it."""

    count: int


@dataclass(frozen=True, slots=True)
class ThreadsEvent:
    """The engine moved a phase's intra-op thread count (memrad.engine.team); `summary` is
    every phase's count now, as the snapshot's `threads` flag says it."""

    at: float
    phase: str  # prefill, decode or batch
    before: int
    after: int
    reason: str
    summary: str

    def render(self) -> str:
        return f"{self.phase} {self.before} → {self.after}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ProtocolError:
    message: str


RECORDS = {cls.__name__: cls for cls in (
    Alternative, Decision, Speculation, SegmentInfo, SessionInfo, PoolStats, FlightInfo, StateSnapshot,
    DecisionEvent, TurnEvent, FlightEvent, ParkEvent, EvictEvent, Dropped, ThreadsEvent, ProtocolError)}


def _encode(value):
    if is_dataclass(value):
        return {"type": type(value).__name__, **{f.name: _encode(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict) and value.get("type") in RECORDS:
        cls = RECORDS[value["type"]]
        return cls(**{k: _decode(v) for k, v in value.items() if k != "type"})
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def to_line(record) -> bytes:
    """One record as a newline-terminated JSON line."""
    return (json.dumps(_encode(record), separators=(",", ":")) + "\n").encode()


def from_line(line: bytes | str):
    """Parse a line written by `to_line`; raises ValueError on anything else."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("type") not in RECORDS:
        raise ValueError(f"not a memra record: {str(line)[:80]}")
    try:
        return _decode(data)
    except TypeError as exc:
        raise ValueError(f"malformed {data.get('type')}: {exc}") from None


def runtime_base() -> tuple[str, str | None]:
    """The one decision of where memrad's runtime files (lock, pidfile, socket) go, with the
    standard library alone (the TUI imports nothing else of memrad): $XDG_RUNTIME_DIR if it
    is an owner-only (0700) directory we own, else /run/user/UID if it is, else
    $TMPDIR/runtime-UID (platformdirs' fallback). Returns (that directory, why
    $XDG_RUNTIME_DIR was passed over, or None). memra's files go in its `memra` folder."""
    import os
    import stat
    import tempfile

    def unsafe(path: str) -> str | None:
        try:
            st = os.stat(path)
        except OSError as exc:
            return exc.strerror or "cannot stat"
        if not stat.S_ISDIR(st.st_mode):
            return "not a directory"
        if st.st_uid != os.geteuid():
            return f"owned by uid {st.st_uid}, not you"
        mode = stat.S_IMODE(st.st_mode)
        return None if mode == 0o700 else f"mode {mode:o}, not 700"

    uid = os.geteuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    why = None
    if xdg:
        why = unsafe(xdg)
        if why is None:
            return xdg, None
        why = f"XDG_RUNTIME_DIR={xdg} is unsafe ({why})"
    if unsafe(f"/run/user/{uid}") is None:
        return f"/run/user/{uid}", why
    return os.path.join(tempfile.gettempdir(), f"runtime-{uid}"), why


def default_socket_path() -> str:
    """Where the daemon puts its socket by default (memrad.paths.socket_path, decided by
    runtime_base)."""
    import os

    return os.path.join(runtime_base()[0], "memra", "memrad.sock")
