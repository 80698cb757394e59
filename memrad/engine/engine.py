"""The engine: one request at a time, plan reuse, prefill on the grid, decode, park.

    plan -> rebuild state at checkpoint c (or cold: c = 0)
         -> prefill(prompt[c:]) on the grid -> [prompt checkpoint P] -> sample -> feed -> ...
                                                  ^ captured before the first generated token
                                                    is fed back (the "init feed"): a client that
                                                    strips or rewrites the reply sends back
                                                    exactly the prompt, never that token.
         -> park: the state, its tokens and text replace the session it resumed from, or,
            when the plan forked another conversation's state, park beside it.

Non-croppable (recurrent, sliding-window) state is snapshotted during prefill at the last
cut <= P (the exact checkpoint: P itself when the prompt ends with a reply header,
memrad.grid), at P (the prompt checkpoint, fast mode), and at each reply anchor it passes
(boundary checkpoints, thinned to a bounded set: memrad.engine.state.snapshot.thin_boundaries), since
it cannot be cut back later. A rewrite of turn k then resumes from the boundary before k.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memrad.chat.chat import Chat
from memrad.chat.detokenize import IncrementalDetokenizer
from memrad.chat.stops import StopMatcher
from memrad.engine.decode import package as step_package
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.steps import describe as describe_step
from memrad.engine.forward import cache_length, prefill
from memrad.engine.model.hardware import Choice
from memrad.engine.model.loader import LoadedModel
from memrad.engine.parking import NoParking, Parking, Prefilled, Publisher, essential
from memrad.engine.sampling import Shaper, make_generator, sample, shapes, token_logprob
from memrad.engine.state.kv import install as install_slabs
from memrad.engine.state.snapshot import Snapshot, is_croppable
from memrad.grid import find_anchors
from memrad.protocol import Decision, SessionInfo, TurnEvent
from memrad.request import Completion, FinishReason, GenerationRequest, TokenLogprob
from memrad.reuse.fingerprint import Segment, chain, derive_openers, derive_reply_header, segments
from memrad.reuse.planner import Mode, Plan, RequestView
from memrad.reuse.pool import Namespace, ParkedSession, ParkingStats, ReusePool
from memrad.reuse.report import decision_event

log = logging.getLogger("memrad.engine")


@dataclass(frozen=True)
class FinishedState:
    """Everything a finished request leaves behind (also handed to `on_finished`).

    `cache` holds exactly `cache_token_ids` (prompt + the generated tokens that were fed
    back); `prompt_checkpoint` is the prompt length, whose state existed before the init
    feed. `prompt_logits` [V] are the logits the first token was sampled from.
    """

    request: GenerationRequest
    cache: Any  # transformers Cache
    cache_token_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    prompt_checkpoint: int
    committed_text: str
    completion: Completion
    prompt_logits: torch.Tensor | None
    session: ParkedSession | None  # what was parked, if anything


FinishHook = Callable[[FinishedState], None]
Sampler = Callable[..., int]  # (logits [V], SamplingParams, generator) -> token id


@dataclass
class _Decoded:
    """What prefill and decode produced for one request."""

    prompt_logits: torch.Tensor | None  # [V]; None if cancelled during prefill
    generated: list[int] = field(default_factory=list)
    num_fed: int = 0  # generated tokens fed back into the cache (decode steps run)
    text: str = ""  # what the client was sent
    ttft_s: float | None = None
    finish: FinishReason = "cancelled"
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, if asked



class Engine:
    """The generation loop over one loaded model; reuse bookkeeping is `parking`'s
    (memrad.engine.parking), chat text is `chat`'s (memrad.chat.chat)."""

    def __init__(self, loaded: LoadedModel, prefill_chunk: int, threads: int,
                 pool: ReusePool | None = None, mode: Mode = "exact", affinity: bool = True,
                 longest_prefix: bool = True, disk: Any = None, compile: str = "off", *,
                 events: Publisher | None = None, on_finished: FinishHook | None = None,
                 sampler: Sampler = sample, tool_fallback: bool = True) -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.mode = mode
        self.affinity = affinity
        self.longest_prefix = longest_prefix
        # Control tokens that open a chat message: the fingerprint splits prompts at them.
        self.openers = derive_openers(loaded.tokenizer)
        # Exact mode also cuts prefill right after each reply header (memrad.grid).
        self.reply_header = derive_reply_header(loaded.tokenizer) if mode == "exact" else ()
        self.on_finished = on_finished
        self.chat = Chat(loaded.tokenizer, tool_fallback=tool_fallback)
        # Next-token choice; a test engine passes a token script (prefill, reuse stay real).
        self.sampler = sampler
        # The one-token step (memrad.engine.decode.decoder): eager, compiled, or transformers' forward.
        self.decoder = Decoder(loaded.model, loaded.context_len, loaded.device, compile, step_package.Recipe(
            str(loaded.folder), loaded.dtype_name, loaded.weights_name, loaded.context_len))
        # Which step that is (llama-shaped, Gemma 3, Qwen3-Next) and its layers; none where transformers decodes.
        self.step_choice = (Choice("none", self.decoder.choice.reason) if self.decoder.step is None
                            else describe_step(loaded.model, loaded.context_len))
        # Control-socket events (memrad.protocol records); published on the engine thread.
        self.events = events if events is not None else Publisher()
        # pool None: reuse disabled, nothing is parked or resumed. disk None: evicted state is dropped.
        self.parking = NoParking(self.new_cache) if pool is None else Parking(
            pool, disk, loaded.tokenizer, self.openers, loaded.model.config, prefill_chunk, mode,
            self.new_cache, self.events)

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def context_len(self) -> int:
        return self.loaded.context_len

    @property
    def runtime_choices(self) -> dict[str, dict[str, str]]:
        """What the hardware choices picked and why (/health, `memrad status`)."""
        loaded = self.loaded
        return {"dtype": {"value": loaded.dtype_name, "reason": loaded.dtype_choice.reason},
                "weights": {"value": loaded.weights_name, "reason": loaded.weights.reason},
                "decode": {"value": self.decoder.choice.value, "reason": self.decoder.choice.reason},
                "step": {"value": self.step_choice.value, "reason": self.step_choice.reason},
                "context": {"value": loaded.context.describe(), "reason": loaded.context.reason()}}

    @property
    def compiling(self) -> bool:
        """A decode-step compile is still running in this process (memrad.daemon's exit)."""
        return self.decoder.compiling()

    def start_background(self) -> None:
        """Start what runs beside serving: the decode step's compile (compile = on or auto)."""
        self.decoder.start()

    def init_worker_thread(self) -> None:
        """Run once on the thread that will call `generate`: fix the intra-op thread count."""
        torch.set_num_threads(self.threads)

    def new_cache(self, in_place: bool = True):
        """An empty cache; on CPU its full-attention layers append in place (memrad.engine.state.kv)
        unless `in_place` is False (transformers' torch.cat layers: the A/B baseline)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.loaded.model.config)
        return install_slabs(cache, self.context_len) if in_place and self.loaded.device.type == "cpu" else cache

    def namespace(self, request: GenerationRequest) -> Namespace:
        return Namespace(self.model_id, request.cache_salt)

    def stats(self) -> ParkingStats | None:
        """The pools' figures; None when the pool is off."""
        return self.parking.stats()

    def infos(self) -> list[SessionInfo]:
        """Every parked session as a SessionInfo record (least recently used first)."""
        return self.parking.infos()

    def plan(self, request: GenerationRequest, prompt_segments: tuple[Segment, ...] | None = None,
             anchors: tuple[int, ...] | None = None) -> Plan:
        """Decide reuse for `request` (pure; the pool is only read). `anchors`: the prompt's
        reply anchors, found here if not given (exact mode)."""
        view = RequestView(request.request_id, request.prompt_ids, request.prompt_text,
                           self.namespace(request), request.identity,
                           tuple(seg.hash for seg in prompt_segments) if prompt_segments is not None
                           else chain(request.prompt_ids, self.openers),
                           None if self.mode != "exact"
                           else anchors if anchors is not None else find_anchors(request.prompt_ids, self.reply_header))
        return self.parking.plan(view, self.affinity, self.longest_prefix)

    def generate(self, request: GenerationRequest, emit: Callable[[str], None],
                 cancelled: Callable[[], bool],
                 on_decision: Callable[[Decision], None] | None = None) -> Completion:
        """Run `request` to completion, calling `emit` with each text delta.

        Blocking; call from the engine's single worker thread. `cancelled` is polled between
        prefill chunks and before every decode step; `on_decision` hears the reuse decision
        before any prefill work starts.
        """
        started = time.perf_counter()
        prompt = request.prompt_ids
        checkpoint = len(prompt)
        max_tokens = request.sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.context_len - checkpoint
        assert checkpoint + max_tokens <= self.context_len, "validated before queueing"

        # The prompt's message segments, computed once: planning, the decision event and the
        # parked session's fingerprint all read them.
        prompt_segments = segments(prompt, self.openers)
        anchors = find_anchors(prompt, self.reply_header)  # () in fast mode: no header to find
        decided = self.parking.load(self.plan(request, prompt_segments, anchors),
                                    replan=lambda: self.plan(request, prompt_segments, anchors))
        log.info("%s %s", request.request_id, decided.decision.render())
        if on_decision is not None:
            on_decision(decided.decision)
        self.events(lambda: decision_event(self.loaded.tokenizer, self.openers, request, decided.decision,
                                           prompt_segments, self.parking.get(decided.decision.candidate)))
        cache, pre = self.parking.check_out(decided, anchors)
        try:
            out = self._prefill_and_decode(request, max_tokens, cache, pre, emit, cancelled, started)
        except BaseException:
            self.parking.resume_failed(decided)
            raise

        fed = tuple(out.generated[: out.num_fed])
        completion = Completion(
            text=out.text, finish_reason=out.finish, prompt_tokens=checkpoint,
            completion_tokens=len(out.generated), cached_tokens=pre.start, ttft_s=out.ttft_s,
            total_s=time.perf_counter() - started, decision=replace(decided.decision, ttft_s=out.ttft_s),
            stop_sequence=out.stop_sequence,
            logprobs=tuple(out.logprobs) if request.sampling.logprobs is not None else None,
        )
        session = self.parking.park(request, self.namespace(request), decided, cache, pre, fed, out.text,
                                    prompt_segments)
        self.events(lambda: TurnEvent(
            at=time.time(), request_id=request.request_id, conversation=session.session_id if session else None,
            identity=request.identity.name if request.identity else None, prompt_tokens=checkpoint,
            cached_tokens=pre.start, completion_tokens=len(out.generated), ttft_s=out.ttft_s,
            outcome=decided.decision.outcome, finish_reason=out.finish,
            total_s=completion.total_s))
        self._hand_on(FinishedState(
            request=request, cache=cache, cache_token_ids=tuple(prompt[: pre.primed_to]) + fed,
            generated_ids=tuple(out.generated), prompt_checkpoint=pre.primed_to,
            committed_text=request.prompt_text + out.text, completion=completion,
            prompt_logits=out.prompt_logits, session=session))
        return completion

    def _prefill_and_decode(self, request: GenerationRequest, max_tokens: int, cache: Any, pre: Prefilled,
                            emit: Callable[[str], None], cancelled: Callable[[], bool], started: float) -> _Decoded:
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        params = request.sampling
        prompt = request.prompt_ids
        checkpoint = len(prompt)
        logits = prefill(model, cache, prompt[pre.start:], pre.start, self.prefill_chunk, cancelled,
                         after_chunk=self._snapshotter(cache, pre, checkpoint), on_grid=self.mode == "exact",
                         anchors=pre.anchors)
        out = _Decoded(prompt_logits=logits)
        if logits is None:
            out.finish = "cancelled"
            return out
        # The prompt checkpoint: state after prompt[:checkpoint], before the init feed.
        assert pre.primed_to == checkpoint, "prompt checkpoint must equal the prompt length"
        assert cache_length(cache) in (None, checkpoint), "cache must hold exactly the prompt"
        generator = make_generator(params.seed)
        feed = self.decoder.feeder()  # one step for the whole reply (memrad.engine.decode.decoder)
        detok = IncrementalDetokenizer(tokenizer, self.chat.format.markup_ids)
        stops = StopMatcher(params.stop)
        sent: list[str] = []
        shaper = self._shaper(request, logits)  # penalties, bias, the grammar's mask; None: none asked
        while True:
            scores = logits if shaper is None else shaper(logits)
            token = self.sampler(scores, params, generator)
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - started
            if token in self.loaded.eos_ids:
                out.finish = "stop"
                break
            out.generated.append(token)
            if shaper is not None:
                shaper.accept(token)
            if params.logprobs is not None:
                out.logprobs.append(token_logprob(scores, token, params.logprobs, self.chat.grammars.token_bytes))
            text = stops.feed(detok.push(token))
            if text:
                sent.append(text)
                emit(text)
            if stops.stopped:
                out.finish, out.stop_sequence = "stop", stops.matched
                break
            if shaper is not None and shaper.complete:  # the grammar allows nothing more: the reply is whole
                out.finish = "stop"
                break
            if len(out.generated) >= max_tokens:
                out.finish = "length"
                break
            if cancelled():
                out.finish = "cancelled"
                break
            logits = feed(cache, token, checkpoint + out.num_fed)
            out.num_fed += 1
        if out.finish != "cancelled":
            tail = stops.feed(detok.flush()) + stops.flush()
            if tail:
                sent.append(tail)
                emit(tail)
        out.text = "".join(sent)
        return out

    def _shaper(self, request: GenerationRequest, logits: torch.Tensor) -> Shaper | None:
        """The request's logits shaping, from its own tokens and its grammar's fresh matcher:
        the same in a cold and a resumed run, and after the step on every decode path."""
        params = request.sampling
        if not shapes(params):
            return None
        matcher = self.chat.grammars.matcher(params.constraint) if params.constraint is not None else None
        return Shaper(params, request.prompt_ids, logits.numel(), self.loaded.eos_ids, matcher)

    def _snapshotter(self, cache: Any, pre: Prefilled, prompt_len: int) -> Callable[[int], None]:
        """Clone non-croppable state at the essential positions and at each reply anchor below
        P (boundary checkpoints) as prefill passes them."""
        wanted: set[int] = set()
        if not is_croppable(cache):
            wanted = essential(prompt_len, self.prefill_chunk, pre.anchors, self.mode) | {a for a in pre.anchors if a < prompt_len}
        if pre.start in wanted and pre.start > 0:
            pre.snapshots[pre.start] = Snapshot.take(cache, pre.start)

        def after_chunk(end: int) -> None:
            pre.primed_to = end
            if end in wanted:
                pre.snapshots[end] = Snapshot.take(cache, end)

        return after_chunk

    def close(self) -> list[str]:
        """At `memrad stop`: stop the decode step's compile and write every parked session to
        the disk tier. Returns one line per session that could not be written (lost), saying
        why. Call once nothing runs on the engine."""
        self.decoder.close()
        return [unsaved.render() for unsaved in self.parking.spill_all()]

    def _hand_on(self, state: FinishedState) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(state)
        except Exception:  # a hook failure must not fail the request it came from
            log.exception("on_finished hook failed for %s", state.request.request_id)
