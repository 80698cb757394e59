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

from memrad.engine.decode import package as step_package
from memrad.chat.format import call_opening, chat_format
from memrad.chat.detokenize import IncrementalDetokenizer
from memrad.engine.decode.decoder import Decoder
from memrad.engine.forward import cache_length, prefill
from memrad.engine.state.kv import install as install_slabs
from memrad.engine.model.loader import LoadedModel
from memrad.chat.render import encode_text, render_chat
from memrad.chat.parse import ReplyParser
from memrad.reuse.report import divergence_context, segment_infos, session_info
from memrad.engine.sampling import make_generator, sample
from memrad.engine.state.snapshot import ParkedState, Snapshot, is_croppable, thin_boundaries
from memrad.grid import cut_floor, find_anchors, is_cut
from memrad.protocol import Decision, DecisionEvent, EvictEvent, ParkEvent, TurnEvent
from memrad.reuse.fingerprint import Segment, chain, derive_openers, derive_reply_header, segments
from memrad.request import Completion, FinishReason, GenerationRequest
from memrad.reuse.planner import Mode, Plan, RequestView, plan
from memrad.reuse.pool import Namespace, ParkedSession, PrefixMatch, ReusePool
from memrad.chat.stops import StopMatcher

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


@dataclass
class _Prefilled:
    """Bookkeeping of one request's prefill."""

    start: int
    primed_to: int
    snapshots: dict[int, Snapshot]
    anchors: tuple[int, ...] = ()  # reply anchors the prompt is cut at (exact mode; memrad.grid)


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


class Engine:
    def __init__(self, loaded: LoadedModel, prefill_chunk: int, threads: int,
                 pool: ReusePool | None = None, mode: Mode = "exact", affinity: bool = True,
                 longest_prefix: bool = True, disk: Any = None, compile: str = "off") -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.pool = pool  # None: reuse disabled, nothing is parked or resumed
        self.mode = mode
        self.affinity = affinity
        self.longest_prefix = longest_prefix
        self.disk = disk  # memrad.engine.state.disk.DiskTier or None: evicted state is dropped
        # Control tokens that open a chat message: the fingerprint splits prompts at them.
        self.openers = derive_openers(loaded.tokenizer)
        # Exact mode also cuts prefill right after each reply header (memrad.grid).
        self.reply_header = derive_reply_header(loaded.tokenizer) if mode == "exact" else ()
        self.on_finished: FinishHook | None = None
        # How chat turns carry tools and reasoning, and how replies parse (memrad.chat.format).
        self.chat_format = chat_format(loaded.tokenizer)
        # Next-token choice; a test engine replaces it with a token script (prefill, reuse stay real).
        self.sampler = sample
        # The one-token step (memrad.engine.decode.decoder): eager, compiled, or transformers' forward.
        self.decoder = Decoder(loaded.model, loaded.context_len, loaded.device, compile, step_package.Recipe(
            str(loaded.folder), loaded.dtype_name, loaded.weights_name, loaded.context_len))
        # Control-socket events (memrad.protocol records); called on the engine thread.
        self.events: Callable[[object], None] | None = None

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
                "decode": {"value": self.decoder.choice.value, "reason": self.decoder.choice.reason}}

    @property
    def vocab_size(self) -> int:
        return len(self.loaded.tokenizer)

    def init_worker_thread(self) -> None:
        """Run once on the thread that will call `generate`: fix the intra-op thread count."""
        torch.set_num_threads(self.threads)

    def render_chat(self, messages: list[dict], tools: list[dict] | None, require_call: bool = False,
                    call_name: str | None = None) -> tuple[str, list[int]]:
        """Render a conversation; with `require_call` the reply starts as a tool call (of
        `call_name` if given), opened in the prompt (memrad.chat.format.call_opening)."""
        opening = call_opening(self.chat_format, call_name) if require_call and tools else ""
        return render_chat(self.loaded.tokenizer, messages, tools, self.chat_format, opening)

    def reply_parser(self, prompt_text: str, parse_tools: bool) -> ReplyParser:
        """A fresh parser for the reply to `prompt_text` (tool calls parsed if `parse_tools`)."""
        return ReplyParser(self.chat_format, prompt_text, parse_tools)

    def encode_prompt(self, text: str) -> list[int]:
        return encode_text(self.loaded.tokenizer, text)

    def decode_prompt(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=False)

    def new_cache(self, in_place: bool = True):
        """An empty cache; on CPU its full-attention layers append in place (memrad.engine.state.kv)
        unless `in_place` is False (transformers' torch.cat layers: the A/B baseline)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.loaded.model.config)
        return install_slabs(cache, self.context_len) if in_place and self.loaded.device.type == "cpu" else cache

    def state_format(self) -> dict[str, str]:
        """What parked state depends on besides its tokens: the disk tier's compatibility key
        (memrad.engine.state.disk). A file made under any other value is never loaded; a new
        setting that changes the state's bits is one more line here."""
        from memrad.engine.state.disk import tokenizer_hash

        return {"model": self.model_id, "tokenizer": tokenizer_hash(self.loaded.tokenizer),
                "dtype": self.loaded.dtype_name, "weights": self.loaded.weights_name,
                "head": self.loaded.head,
                "device": self.loaded.device.type,
                "chunk": str(self.prefill_chunk), "mode": self.mode}

    def namespace(self, request: GenerationRequest) -> Namespace:
        return Namespace(self.model_id, request.cache_salt)

    def plan(self, request: GenerationRequest, prompt_segments: tuple[Segment, ...] | None = None,
             anchors: tuple[int, ...] | None = None) -> Plan:
        """Decide reuse for `request` (pure; the pool is only read). `anchors`: the prompt's
        reply anchors, found here if not given (exact mode)."""
        if self.pool is None:
            return Plan(Decision(request.request_id, "cold", "reuse pool disabled", 0,
                                 request.num_prompt_tokens))
        view = RequestView(request.request_id, request.prompt_ids, request.prompt_text,
                           self.namespace(request), request.identity,
                           tuple(seg.hash for seg in prompt_segments) if prompt_segments is not None
                           else chain(request.prompt_ids, self.openers),
                           None if self.mode != "exact"
                           else anchors if anchors is not None else find_anchors(request.prompt_ids, self.reply_header))
        sessions, matches = self._candidates(view.namespace, view.prompt_ids)
        return plan(view, sessions, self.mode, self.prefill_chunk, self.affinity, self.longest_prefix, matches)

    def _candidates(self, namespace: Namespace, prompt_ids: tuple[int, ...]
                    ) -> tuple[list[ParkedSession], tuple[PrefixMatch, ...]]:
        """Parked sessions in memory and on disk, and the prefix index's matches among them."""
        sessions, matches = self.pool.sessions(), self.pool.prefix_matches(namespace, prompt_ids)
        if self.disk is not None:
            sessions += self.disk.pool.sessions()
            matches += self.disk.pool.prefix_matches(namespace, prompt_ids)
        return sessions, matches

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
        decided = self.plan(request, prompt_segments, anchors)
        decided = self._loadable(request, decided, prompt_segments, anchors)
        log.info("%s %s", request.request_id, decided.decision.render())
        if on_decision is not None:
            on_decision(decided.decision)
        self._publish_decision(request, decided, prompt_segments)
        cache, pre = self._prefill_start(decided, anchors)
        try:
            out = self._prefill_and_decode(request, max_tokens, cache, pre, emit, cancelled, started)
        except BaseException:
            if decided.session is not None and not decided.fork:
                self._drop_parent(decided.session, "its resume failed")
            raise

        fed = tuple(out.generated[: out.num_fed])
        completion = Completion(
            text=out.text,
            finish_reason=out.finish,
            prompt_tokens=checkpoint,
            completion_tokens=len(out.generated),
            cached_tokens=pre.start,
            ttft_s=out.ttft_s,
            total_s=time.perf_counter() - started,
            decision=replace(decided.decision, ttft_s=out.ttft_s),
            stop_sequence=out.stop_sequence,
        )
        session = self._park(request, decided, cache, pre, fed, out.text, prompt_segments)
        self._publish(TurnEvent(
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

    def _prefill_and_decode(self, request: GenerationRequest, max_tokens: int, cache: Any, pre: _Prefilled,
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
        detok = IncrementalDetokenizer(tokenizer, self.chat_format.markup_ids)
        stops = StopMatcher(params.stop)
        sent: list[str] = []
        while True:
            token = self.sampler(logits, params, generator)
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - started
            if token in self.loaded.eos_ids:
                out.finish = "stop"
                break
            out.generated.append(token)
            text = stops.feed(detok.push(token))
            if text:
                sent.append(text)
                emit(text)
            if stops.stopped:
                out.finish, out.stop_sequence = "stop", stops.matched
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

    def _loadable(self, request: GenerationRequest, decided: Plan, prompt_segments: tuple[Segment, ...],
                  anchors: tuple[int, ...]) -> Plan:
        """Load a chosen disk session's state; a file that fails its checks is deleted (by the
        disk tier, with a log line) and the request is planned again without it."""
        while decided.session is not None and decided.session.on_disk:
            state = self.disk.load(decided.session, self.new_cache)
            if state is not None:
                return replace(decided, session=replace(decided.session, state=state))
            self._evicted_from_disk(decided.session)
            decided = self.plan(request, prompt_segments, anchors)
        return decided

    def _prefill_start(self, decided: Plan, anchors: tuple[int, ...]) -> tuple[Any, _Prefilled]:
        if decided.session is None:
            return self.new_cache(), _Prefilled(0, 0, {}, anchors)
        parent = decided.session
        if decided.fork:
            # Another conversation's state: copy its rows, leave it parked and unchanged.
            (self.disk.pool if parent.on_disk else self.pool).touch(parent.session_id)
            cache = parent.state.rebuild(self.loaded.model.config, decided.checkpoint, copy=not parent.on_disk)
            return cache, _Prefilled(decided.checkpoint, decided.checkpoint, {}, anchors)
        # A resume that replaces its parent hands the parent's buffers on (the new rows
        # overwrite the parent's rows past the checkpoint): check it out first, so the pool
        # never lists a state that is being written. Its boundary snapshots below the
        # checkpoint stay exact and pass to the successor.
        self.pool.remove(parent.session_id)
        if self.disk is not None:
            self.disk.forget(parent.session_id)
        cache = parent.state.rebuild(self.loaded.model.config, decided.checkpoint)
        return cache, _Prefilled(decided.checkpoint, decided.checkpoint, parent.state.below(decided.checkpoint),
                                 anchors)

    def _essential(self, prompt_len: int, anchors: tuple[int, ...]) -> set[int]:
        """Snapshot positions every non-croppable session keeps: the exact checkpoint (the last
        cut <= P) and, in fast mode, P itself."""
        wanted = {cut_floor(prompt_len, self.prefill_chunk, anchors)}
        if self.mode == "fast":
            wanted.add(prompt_len)
        return wanted

    def _snapshotter(self, cache: Any, pre: _Prefilled, prompt_len: int) -> Callable[[int], None]:
        """Clone non-croppable state at the essential positions and at each reply anchor below
        P (boundary checkpoints) as prefill passes them."""
        wanted: set[int] = set()
        if not is_croppable(cache):
            wanted = self._essential(prompt_len, pre.anchors) | {a for a in pre.anchors if a < prompt_len}
        if pre.start in wanted and pre.start > 0:
            pre.snapshots[pre.start] = Snapshot.take(cache, pre.start)

        def after_chunk(end: int) -> None:
            pre.primed_to = end
            if end in wanted:
                pre.snapshots[end] = Snapshot.take(cache, end)

        return after_chunk

    def _exact_limit(self, decided: Plan, primed_to: int) -> int:
        """Cuts <= the result came from canonical prefill chunks (see DESIGN: Exactness)."""
        start, parent = decided.checkpoint, decided.session
        if parent is None or (start <= parent.exact_limit and is_cut(start, self.prefill_chunk, parent.anchors)):
            return primed_to
        return min(start, parent.exact_limit)

    def _park(self, request: GenerationRequest, decided: Plan, cache: Any, pre: _Prefilled,
              fed: tuple[int, ...], text: str, prompt_segments: tuple[Segment, ...]) -> ParkedSession | None:
        if self.pool is None or pre.primed_to == 0:
            return None
        token_ids = tuple(request.prompt_ids[: pre.primed_to]) + fed
        whole_prompt = pre.primed_to == len(request.prompt_ids)  # else cancelled mid-prompt
        croppable = is_croppable(cache)
        keep = self._essential(len(request.prompt_ids), pre.anchors) | thin_boundaries(pre.snapshots, pre.anchors)
        snapshots = {pos: snap for pos, snap in pre.snapshots.items() if pos < len(token_ids) and pos in keep}
        state = ParkedState(final=Snapshot.adopt(cache, len(token_ids)), snapshots=snapshots,
                            croppable=croppable)
        now = time.time()
        parent = decided.session
        session = ParkedSession(
            session_id=self.pool.new_id(),
            namespace=self.namespace(request),
            identity=request.identity,
            token_ids=token_ids,
            text=request.prompt_text + text,
            prompt_checkpoint=pre.primed_to,
            checkpoints=() if croppable else tuple(sorted({*snapshots, len(token_ids)})),
            croppable=croppable,
            exact_limit=self._exact_limit(decided, pre.primed_to),
            fingerprint=tuple(seg.hash for seg in prompt_segments) if whole_prompt
            else chain(token_ids[: pre.primed_to], self.openers),
            num_bytes=state.num_bytes,
            created_at=parent.created_at if parent is not None and not decided.fork else now,
            last_used_at=now,
            hits=parent.hits + 1 if parent is not None and not decided.fork else 0,
            anchors=tuple(a for a in pre.anchors if a <= pre.primed_to),
            state=state,
        )
        if not self.pool.can_park(session.num_bytes):
            log.info("%s not parked: %d bytes exceed the pool's cap of %d bytes", request.request_id,
                     session.num_bytes, self.pool.max_bytes)
            if parent is not None and not decided.fork:
                self._drop_parent(parent, "its successor exceeds the pool's byte cap")
            return None
        replaced = parent.session_id if parent is not None and not decided.fork else None
        for old in self.pool.park(session, replaces=replaced):
            self._evicted(old)
        if self.events is not None:
            info = session_info(self.loaded.tokenizer, session, self.openers, prompt_segments if whole_prompt else None)
            self._publish(ParkEvent(now, info, replaced))
        return session

    def _evicted(self, old: ParkedSession) -> None:
        """The memory cap pushed `old` out: spill it to the disk tier (if any), else drop it."""
        spilled = self.disk is not None and self.disk.spill(old, self._evicted_from_disk)
        log.info("evicted %s (%d tokens, %d bytes)%s", old.session_id, old.num_tokens, old.num_bytes,
                 "; spilled to disk" if spilled else "")
        if not spilled:
            self._publish(EvictEvent(time.time(), old.session_id, old.num_tokens, old.num_bytes))
        elif self.events is not None:  # the same session, now on disk
            on_disk = self.disk.pool.get(old.session_id)
            self._publish(ParkEvent(time.time(), session_info(self.loaded.tokenizer, on_disk, self.openers),
                                    old.session_id))

    def _evicted_from_disk(self, old: ParkedSession) -> None:
        self._publish(EvictEvent(time.time(), old.session_id, old.num_tokens, old.num_bytes))

    def close(self) -> None:
        """At `memrad stop`: write every parked session to the disk tier (most recent last, so
        the disk's LRU keeps the freshest). Call once nothing runs on the engine."""
        self.decoder.close()
        if self.pool is None or self.disk is None:
            return
        sessions = self.pool.sessions()
        written = sum(self.disk.spill(s, self._evicted_from_disk) for s in sessions)
        log.info("wrote %d of %d parked sessions to %s", written, len(sessions), self.disk.directory)

    def _drop_parent(self, parent: ParkedSession, why: str) -> None:
        """A checked-out parent that nothing replaces is gone: say so (log, control socket)."""
        log.info("dropped %s (%d tokens): %s", parent.session_id, parent.num_tokens, why)
        self._publish(EvictEvent(time.time(), parent.session_id, parent.num_tokens, parent.num_bytes))

    def session_infos(self) -> list:
        """Every parked session as a SessionInfo record (least recently used first)."""
        if self.pool is None:
            return []
        on_disk = self.disk.pool.sessions() if self.disk is not None else []
        return [session_info(self.loaded.tokenizer, s, self.openers) for s in on_disk + self.pool.sessions()]

    def _publish(self, event: object) -> None:
        if self.events is not None:
            try:
                self.events(event)
            except Exception:  # an inspector must never break serving
                log.exception("publishing %s failed", type(event).__name__)

    def _publish_decision(self, request: GenerationRequest, decided: Plan,
                          prompt_segments: tuple[Segment, ...]) -> None:
        if self.events is None:
            return
        d = decided.decision
        context, candidate_segments = None, ()
        candidate = self.pool.get(d.candidate) if d.candidate is not None and self.pool is not None else None
        if candidate is not None:
            parked_prompt = candidate.token_ids[: candidate.prompt_checkpoint]
            candidate_segments = segment_infos(self.loaded.tokenizer, parked_prompt,
                                               segments(parked_prompt, self.openers))
            if d.divergence is not None:
                context = divergence_context(self.loaded.tokenizer, request.prompt_ids, candidate.token_ids,
                                             d.divergence)
        self._publish(DecisionEvent(
            at=time.time(), decision=d, prompt_tokens=request.num_prompt_tokens,
            identity=request.identity.name if request.identity else None,
            segments=segment_infos(self.loaded.tokenizer, request.prompt_ids, prompt_segments),
            divergence_context=context, candidate_segments=candidate_segments))

    def _hand_on(self, state: FinishedState) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(state)
        except Exception:  # a hook failure must not fail the request it came from
            log.exception("on_finished hook failed for %s", state.request.request_id)
