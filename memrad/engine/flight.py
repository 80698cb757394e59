"""One request in flight on the engine: its prefill chunks still to run, its reply so far.

The engine's scheduler (memrad.engine.engine) holds up to max_batch flights and moves each
one step per iteration; a flight is the state one request's generation loop used to keep in
locals, so a request computes the same whether it runs alone or beside others:

    admitted (planned, state checked out) -> "prefill": one or more grid chunks per iteration
        -> prompt logits -> sample ("take") -> "decode": the token is fed in the next batched
        step, its logits sampled ... -> "done" (eos, stop, length, grammar, cancel, error)
        -> the engine parks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from memrad.chat.detokenize import IncrementalDetokenizer
from memrad.chat.stops import StopMatcher
from memrad.engine.forward import cache_length, prefill_span
from memrad.engine.interrupt import Interrupted, between_layers, rewind_layers
from memrad.engine.parking import Prefilled
from memrad.engine.sampling import Shaper, make_generator, token_logprob
from memrad.engine.state.snapshot import is_croppable
from memrad.engine.speculation import Speculating
from memrad.protocol import FlightInfo
from memrad.protocol import Speculation as SpeculationRecord
from memrad.request import Completion, FinishReason, GenerationRequest, TokenLogprob
from memrad.reuse.fingerprint import Segment
from memrad.reuse.planner import Plan

Phase = Literal["prefill", "decode", "done"]


@dataclass
class Reply:
    """What prefill and decode produced for one request."""

    prompt_logits: torch.Tensor | None = None  # [V]; None if cancelled during prefill
    generated: list[int] = field(default_factory=list)
    num_fed: int = 0  # generated tokens fed back into the cache (decode steps run)
    sent: list[str] = field(default_factory=list)  # what the client was sent
    ttft_s: float | None = None
    finish: FinishReason = "cancelled"
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, if asked
    error: str | None = None  # why the grammar could not go on (finish "grammar")

    @property
    def text(self) -> str:
        return "".join(self.sent)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The engine's parts a flight samples with (the same for every flight of an engine)."""

    sampler: Callable[..., int]  # (logits [V], SamplingParams, generator) -> token id
    eos_ids: frozenset[int] | tuple[int, ...]
    tokenizer: Any
    markup_ids: Any
    token_bytes: Any
    shaper: Callable[[GenerationRequest, torch.Tensor], Shaper | None]


class Flight:
    """One admitted request. Mutated by the engine thread only, one step at a time."""

    def __init__(self, request: GenerationRequest, emit: Callable[[str], None], cancelled: Callable[[], bool],
                 decided: Plan, cache: Any, pre: Prefilled, spans: list[tuple[int, int]],
                 after_chunk: Callable[[int], None], feed: Any, sampling: Sampling,
                 prompt_segments: tuple[Segment, ...], max_tokens: int, started: float,
                 device: torch.device, speculating: Speculating | SpeculationRecord | None = None) -> None:
        self.request, self.emit, self.cancelled = request, emit, cancelled
        self.decided, self.cache, self.pre = decided, cache, pre
        assert spans, "a flight primes at least one token (the planner leaves a suffix)"
        self.spans = list(spans)  # grid chunks still to prefill, in order
        self.after_chunk = after_chunk
        self.feed = feed  # a BatchStep (grouped with others) or a OneRowFeed, for the whole reply; `.step` names it
        # Drafts verified as rows of one step (memrad.engine.speculation), or the record saying why not.
        self.speculating = speculating if isinstance(speculating, Speculating) else None
        self._not_speculating = speculating if isinstance(speculating, SpeculationRecord) else None
        self.sampling = sampling
        self.prompt_segments = prompt_segments
        self.max_tokens = max_tokens
        self.started = started
        self.phase: Phase = "prefill"
        self.prefilled_at = -1  # the engine's prefill turn this flight last had (-1: none yet)
        self.reported: tuple[Phase, int] | None = None  # (phase, tokens) the last FlightEvent said
        self.out = Reply()
        self.pending: int | None = None  # the sampled token the next decode step feeds
        self.error: BaseException | None = None
        self.completion: Completion | None = None
        self._ids = torch.tensor(request.prompt_ids[pre.start:], dtype=torch.long, device=device)
        self._params = request.sampling
        self._generator = make_generator(self._params.seed)
        self._detok = IncrementalDetokenizer(sampling.tokenizer, sampling.markup_ids)
        self._stops = StopMatcher(self._params.stop)
        self._shaper: Shaper | None = None
        # Every layer can be cut back: a cancel lands between decoder layers (memrad.engine.interrupt),
        # a request attached to this one forks it at any cut (memrad.engine.attaching)
        self.croppable = is_croppable(cache)

    @property
    def checkpoint(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def position(self) -> int:
        """Where the pending token goes in the cache."""
        return self.checkpoint + self.out.num_fed

    @property
    def tokens_so_far(self) -> int:
        """Prompt tokens primed while prefilling; generated tokens while decoding."""
        return self.pre.primed_to if self.phase == "prefill" else len(self.out.generated)

    def info(self) -> FlightInfo:
        """This flight as the control socket's record (memra-tui's in-flight rows)."""
        request, session = self.request, self.decided.session
        return FlightInfo(request.request_id, request.identity.name if request.identity else None,
                          session.session_id if session is not None else None, self.phase, self.checkpoint,
                          self.pre.primed_to, len(self.out.generated), round(time.perf_counter() - self.started, 3),
                          self.feed.step)

    def prefill(self, model: Any, budget: int) -> int:
        """Run grid chunks until `budget` tokens ran (at least one chunk); returns the tokens
        run. The last chunk's logits are sampled at once (the first token). A cancel ends the
        flight between chunks, or between layers mid-chunk (memrad.engine.interrupt): the
        cache then holds exactly the chunks that completed, up to `pre.primed_to`."""
        ran = 0
        while self.spans and (ran == 0 or ran + self.spans[0][1] - self.spans[0][0] <= budget):
            if self.cancelled():
                self._end("cancelled")
                return ran
            a, b = self.spans[0]
            try:
                if self.croppable:
                    with between_layers(model, self.cancelled):
                        logits = prefill_span(model, self.cache, self._ids, self.pre.start, a, b)
                else:
                    logits = prefill_span(model, self.cache, self._ids, self.pre.start, a, b)
            except Interrupted:
                rewind_layers(self.cache, a)
                self._end("cancelled")
                return ran
            self.spans.pop(0)
            self.after_chunk(b)
            ran += b - a
            if not self.spans:
                self._primed(logits.float())
        return ran

    def fed(self, logits: torch.Tensor) -> None:
        """The decode step fed the pending token; `logits` [V] are the next token's."""
        self.out.num_fed += 1
        self.pending = None
        self._take(logits)

    def fed_rows(self, logits: torch.Tensor, drafts: list[int]) -> int:
        """A verify step fed the pending token and `drafts` after it; `logits` [1 + len(drafts), V]:
        row i's are the next token's after the pending token and drafts[:i]. Takes row 0 as `fed`
        does, and each next row while the token taken equals its draft (that row's input), so the
        reply is the one plain steps would give; returns the drafts accepted."""
        accepted = 0
        for i, row in enumerate(logits):
            self.fed(row)
            if i == len(drafts) or self.pending != drafts[i]:
                break
            accepted += 1
        return accepted

    def allowed(self, drafts: list[int]) -> list[int]:
        """`drafts` up to the first its grammar refuses after the pending token (all of them
        without a grammar): a refused draft could never be taken, so it is not given a row."""
        return drafts if self._shaper is None else drafts[: self._shaper.allows(drafts)]

    def speculation(self) -> SpeculationRecord | None:
        """How this reply decoded with drafts (None: speculation was not considered)."""
        return self.speculating.figures() if self.speculating is not None else self._not_speculating

    def fail(self, error: BaseException) -> None:
        self.error, self.phase = error, "done"

    def _primed(self, logits: torch.Tensor) -> None:
        # The prompt checkpoint: state after prompt[:checkpoint], before the init feed.
        assert self.pre.primed_to == self.checkpoint, "prompt checkpoint must equal the prompt length"
        assert cache_length(self.cache) in (None, self.checkpoint), "cache must hold exactly the prompt"
        self.out.prompt_logits = logits
        self._shaper = self.sampling.shaper(self.request, logits)
        self.phase = "decode"
        self._take(logits)

    def _take(self, logits: torch.Tensor) -> None:
        """Sample from `logits` and decide: another token to feed, or the reply's end."""
        out, params, shaper = self.out, self._params, self._shaper
        scores = logits if shaper is None else shaper(logits)
        if shaper is not None and shaper.error is not None:  # its mask failed: only eos is left, not a reply
            return self._grammar_failed(shaper.error)
        token = self.sampling.sampler(scores, params, self._generator)
        if out.ttft_s is None:
            out.ttft_s = time.perf_counter() - self.started
        if token in self.sampling.eos_ids:
            return self._end("stop")
        out.generated.append(token)
        if shaper is not None:
            shaper.accept(token)
            if shaper.error is not None:  # the grammar refused a token its own mask allowed
                return self._grammar_failed(shaper.error)
        if params.logprobs is not None:
            out.logprobs.append(token_logprob(scores, token, params.logprobs, self.sampling.token_bytes))
            self.emit(out.logprobs[-1])  # ahead of the token's text: a stream carries it on the next chunk
        self._send(self._stops.feed(self._detok.push(token)))
        if self._stops.stopped:
            out.stop_sequence = self._stops.matched
            return self._end("stop")
        if shaper is not None and shaper.complete:  # the grammar allows nothing more: the reply is whole
            return self._end("stop")
        if len(out.generated) >= self.max_tokens:
            return self._end("length")
        if self.cancelled():
            return self._end("cancelled")
        self.pending = token

    def _grammar_failed(self, why: str) -> None:
        """The grammar cannot continue (llguidance hit a limit at run time): the reply ends
        as an error the client sees, never as a "stop" with text the grammar did not finish."""
        if self.out.ttft_s is None:
            self.out.ttft_s = time.perf_counter() - self.started
        self.out.error = why
        self._end("grammar")

    def _end(self, finish: FinishReason) -> None:
        self.out.finish, self.phase, self.pending = finish, "done", None
        if finish not in ("cancelled", "grammar"):
            self._send(self._stops.feed(self._detok.flush()) + self._stops.flush())

    def _send(self, text: str) -> None:
        if text:
            self.out.sent.append(text)
            self.emit(text)

