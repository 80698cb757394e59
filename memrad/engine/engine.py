"""The engine: plan reuse, prefill on the grid, decode, park; several requests in flight.

Each request is a Flight (memrad.engine.flight): admitted (planned, its state checked out),
then moved by `step`: one batched decode step for every decoding flight, then prefill
chunks of one flight still priming (round-robin). For one request:

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
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from memrad.chat.chat import Chat
from memrad.engine.attaching import Attacher, Hold
from memrad.engine.decode import builder
from memrad.engine.decode.batch import BatchStep
from memrad.engine.decode.decoder import Decoder, said_sizes
from memrad.engine.decode.steps import describe as describe_step, has_batched
from memrad.engine.flight import Flight, Sampling
from memrad.engine.forward import prefill_spans
from memrad.engine.model.hardware import Choice
from memrad.engine.model.loader import LoadedModel
from memrad.engine.model.rope import Scaling, rule_for
from memrad.engine.events import Publisher
from memrad.engine.parking import (DiskLike, NoDisk, NoParking, Parking, ParkingLike, Prefilled, Snapshotter,
                                   essential)
from memrad.engine import speculation
from memrad.engine.sampling import Shaper, sample, shapes
from memrad.engine.model import kv_dtype
from memrad.engine.state.layers import install as install_slabs
from memrad.engine.state.snapshot import is_croppable
from memrad.engine.model.products import Products
from memrad.engine.team import PHASES, Ceiling, TeamPolicy
from memrad.engine.threads import Team, cpu_ceiling
from memrad.engine.threads import pin as pin_threads
from memrad.grid import find_anchors
from memrad.protocol import Decision, FlightEvent, FlightInfo, PoolStats, SessionInfo, ThreadsEvent, TurnEvent
from memrad.request import Completion, GenerationRequest, TokenLogprob
from memrad.reuse.attach import Attachment
from memrad.reuse.fingerprint import Segment, chain, derive_openers, derive_reply_header, segments
from memrad.reuse.planner import Mode, Plan, RequestView
from memrad.reuse.pool import Namespace, ParkedSession, ReusePool
from memrad.reuse.report import decision_event

log = logging.getLogger("memrad.engine")

REPORT_EVERY = 16  # decoded tokens between two FlightEvents of one request


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


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How an Engine runs, fixed for its life (memrad.engine.build.engine_for fills it from
    Settings; tests and benches name what they change)."""

    prefill_chunk: int  # tokens per prefill chunk: the canonical grid's step (memrad.grid)
    threads: int  # the engine thread's intra-op team (memrad.engine.threads)
    mode: Mode = "exact"  # exact: a resume starts on the grid, so resumed equals cold; fast: reuse everything
    affinity: bool = True  # the affinity tier nominates (MEMRA_AFFINITY=0: the A/B arm)
    longest_prefix: bool = True  # the longest common prefix with any parked session nominates
    compile: str = "off"  # the one-row decode step: off, on, auto or wait (memrad.engine.decode.decoder)
    tool_fallback: bool = True  # memra's tool-call convention where the chat template has none
    # Requests in flight together (memrad.engine.flight); 1 runs one at a time.
    max_batch: int = 1
    # Each iteration prefills at least one chunk and more while under this many tokens (None: one chunk).
    prefill_budget: int | None = None
    # "batched": one step of max_batch rows where the step has a batched twin (weights read once);
    # "rows": each flight on the one-row step (compiled once ready), one after another.
    batch_decode: str = "batched"
    # A grammar's compile (with its first mask) slower than this is refused (limits.grammar_compile_s).
    grammar_compile_s: float | None = None
    # True: the intra-op count per phase follows the CPU actually free (memrad.engine.team),
    # `threads` the most it starts at; False: `threads` for every step (model.threads set).
    adapt_threads: bool = False
    # Drafts from the context verified as rows of one step (memrad.engine.speculation): auto or off.
    # Off for engines made directly (tests, benches say what they compare); the daemon's setting,
    # engine.speculate, defaults to auto (memrad.config).
    speculate: str = "off"


class Engine:
    """The generation loop over one loaded model; reuse bookkeeping is `parking`'s
    (memrad.engine.parking), chat text is `chat`'s (memrad.chat.chat)."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions, pool: ReusePool | None = None,
                 disk: DiskLike = NoDisk(), *, events: Publisher | None = None,
                 on_finished: FinishHook | None = None, sampler: Sampler = sample) -> None:
        """`pool` None: reuse disabled, nothing is parked or resumed; `disk` NoDisk: evicted
        state is dropped (NoDisk holds nothing, so one default serves every engine)."""
        self.loaded = loaded
        self.options = options
        self.prefill_chunk = options.prefill_chunk
        self.threads = options.threads
        mode = self.mode = options.mode
        self.affinity = options.affinity
        self.longest_prefix = options.longest_prefix
        # Control tokens that open a chat message: the fingerprint splits prompts at them.
        self.openers = derive_openers(loaded.tokenizer)
        # Exact mode also cuts prefill right after each reply header (memrad.grid).
        self.reply_header = derive_reply_header(loaded.tokenizer) if mode == "exact" else ()
        self.on_finished = on_finished
        self.max_batch = options.max_batch
        assert options.batch_decode in ("batched", "rows"), options.batch_decode
        assert options.speculate in speculation.SETTINGS, options.speculate
        self.batch_decode = options.batch_decode
        self.prefill_budget = options.prefill_budget or options.prefill_chunk
        self._flights: list[Flight] = []
        self._steps = 0  # prefill turns handed out (the round-robin's clock)
        self._rotation = 0  # batched steps run (which flight drafts first: memrad.engine.speculation)
        self._drafts_so_far = (0, 0, 0, 0)  # finished replies' drafted, accepted, decode steps, fed tokens
        self.chat = Chat(loaded.tokenizer, tool_fallback=options.tool_fallback,
                         grammar_compile_s=options.grammar_compile_s)
        # Next-token choice; a test engine passes a token script (prefill, reuse stay real).
        self.sampler = sampler
        self._sampling = Sampling(lambda *args: self.sampler(*args), loaded.eos_ids, loaded.tokenizer,
                                  self.chat.format.markup_ids, self.chat.grammars.token_bytes, self._shaper)
        # The one-token step (memrad.engine.decode.decoder): eager, compiled, or transformers' forward.
        self.decoder = Decoder(loaded.model, loaded.context_len, loaded.device, options.compile, builder.Recipe.of(loaded),
            batch_rows=self.max_batch if self._batches() else None,
            run_rows=speculation.RUN_ROWS if options.speculate == "auto" else None)
        # Which step that is (llama-shaped, Gemma 3, Qwen3-Next) and its layers; none where transformers decodes.
        self.step_choice = (Choice("none", self.decoder.choice.reason) if self.decoder.step is None
                            else describe_step(loaded.model, loaded.context_len))
        # Which rope each request runs under: native where it fits, scaled past (memrad.engine.model.rope).
        self.rope_rule = rule_for(loaded.context, loaded.rope, self.decoder.native_why is None,
                                  self.decoder.native_why or "")
        # Control-socket events (memrad.protocol records); published on the engine thread.
        self.events = events if events is not None else Publisher()
        self.parking: ParkingLike = NoParking(self.new_cache) if pool is None else Parking(
            pool, disk, loaded.tokenizer, self.openers, loaded.model.config, self.prefill_chunk, mode,
            self.new_cache, self.events)
        # A request extending the prompt of one still on the model forks its live state
        # (memrad.reuse.attach): a reuse tier, so off with the pool.
        self.attacher = Attacher(self.prefill_chunk, mode, loaded.model.config) if pool is not None else None
        # The engine thread's intra-op count, per phase (memrad.engine.threads.Team).
        self.team = Team(_team_policy(options, loaded.products), on_change=self._threads_changed,
                         ceiling=lambda: _capped(cpu_ceiling(), options.threads))

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
                "tensors": {"value": loaded.tensors.value, "reason": loaded.tensors.reason},
                "decode": {"value": self.decoder.choice.value, "reason": self.decoder.choice.reason},
                "step": {"value": self.step_choice.value, "reason": self.step_choice.reason},
                "context": {"value": self.rope_rule.describe(), "reason": self.rope_rule.reason(),
                            "native_context_length": loaded.context.native_tokens,
                            "context_scaling": loaded.context.describe()},
                "attention": {"value": loaded.attention.value, "reason": loaded.attention.reason},
                "kv": {"value": loaded.kv.value, "reason": loaded.kv.reason},
                "products": {"value": loaded.products.choice.value, "reason": loaded.products.choice.reason},
                "batch": self._batch_choice(), "threads": self._threads_choice(),
                "speculation": self._speculation_choice()}

    @property
    def thread_counts(self) -> dict[str, int]:
        """The intra-op count each phase runs at now (/metrics)."""
        return {phase: self.team.policy.count(phase) for phase in PHASES}

    def _speculation_choice(self) -> dict[str, str]:
        """Whether replies draft from their context, and how the finished ones fared (`memrad status`)."""
        if self.options.speculate == "off":
            return {"value": "off", "reason": "speculate = off: one token per decode step"}
        drafted, accepted, steps, fed = self._drafts_so_far
        figures = (f"finished replies so far: {accepted} of {drafted} drafted tokens kept"
                   + (f" ({accepted / drafted:.0%})" if drafted else "")
                   + (f", {fed / steps:.2f} tokens per decode step" if steps else ""))
        return {"value": "auto", "reason": "drafts from the context verified as rows of the step each reply decodes "
                                           f"on (memra.speculation says per reply); {figures}"}

    def _threads_choice(self) -> dict[str, str]:
        policy = self.team.policy
        return {"value": ", ".join(f"{phase} {policy.count(phase)}" for phase in PHASES),
                "reason": "; ".join(f"{phase}: {policy.reason(phase)}" for phase in PHASES)}

    def _threads_changed(self, change: ThreadsEvent) -> None:
        at = time.time()  # the policy stamps its own (monotonic) clock
        self.events(lambda: replace(change, at=at))

    def _batch_choice(self) -> dict[str, str]:
        """How requests in flight together decode (`memrad status`, /health)."""
        if self.max_batch == 1:
            return {"value": "one at a time", "reason": "max_batch = 1: one request on the model, the one-row step"}
        if self._batches() and has_batched(self.decoder.eager_step):
            how = self.decoder.batch_choice
            return {"value": f"batched, {self.max_batch} rows",
                    "reason": f"max_batch = {self.max_batch}: the requests decoding together in one step of "
                              f"{said_sizes(self.decoder.batch_sizes, 'or')} rows, the fewest that hold them "
                              "(padded, so a request's bits do not depend on its neighbours; one decoding alone runs "
                              f"the one-row step, whose bits a batched row has), {how.value}: {how.reason}"}
        why = ("batch_decode = rows" if self.batch_decode == "rows"
               else f"{self.decoder.choice.value} decode has no batched step for this model")
        return {"value": f"{self.max_batch} in flight, one row each",
                "reason": f"max_batch = {self.max_batch}: {why}; the requests in flight decode one after another "
                          "in each step, each on the one-row step"}

    def _batches(self) -> bool:
        return self.max_batch > 1 and self.batch_decode == "batched"

    @property
    def running_torch(self) -> bool:
        """A background thread still runs torch in this process: the decode step's compile or
        the eager batched step's checks (memrad.daemon's exit)."""
        return self.decoder.running_torch()

    def start_background(self) -> None:
        """Start what runs beside serving: the decode step's compile (compile = on or auto), and
        the eager batched step's making where requests would decode on it (`warm_batch`)."""
        self.decoder.start()
        if self._batches():
            self.decoder.warm_batch(self.decoder.batch_rows or self.max_batch)

    def init_worker_thread(self) -> None:
        """Run once on the thread that will call `admit` and `step` (or `generate`): fix the
        intra-op thread count (the daemon's one team: memrad.engine.threads)."""
        pin_threads(self.threads)

    def new_cache(self, in_place: bool = True):
        """An empty cache; on CPU its full-attention layers append in place (memrad.engine.state.kv)
        unless `in_place` is False (transformers' torch.cat layers: the A/B baseline)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.loaded.model.config)
        return (install_slabs(cache, self.context_len, kv_dtype.of(self.loaded.model))
                if in_place and self.loaded.device.type == "cpu" else cache)

    def namespace(self, request: GenerationRequest) -> Namespace:
        return Namespace(self.model_id, request.cache_salt)

    def stats(self) -> PoolStats:
        """The pools' figures; zeros for a tier that is off."""
        return self.parking.stats()

    def infos(self) -> list[SessionInfo]:
        """Every parked session as a SessionInfo record (least recently used first)."""
        return self.parking.infos()

    def scaling(self, request: GenerationRequest) -> Scaling:
        """The rope `request` runs under, from its prompt and its reply budget (max_tokens as the
        server fitted it; none: the rest of the context). Pure."""
        num_prompt = len(request.prompt_ids)
        budget = request.sampling.max_tokens
        return self.rope_rule.choose(num_prompt, budget if budget is not None else self.context_len - num_prompt)

    def plan(self, request: GenerationRequest, prompt_segments: tuple[Segment, ...] | None = None,
             anchors: tuple[int, ...] | None = None) -> Plan:
        """Decide reuse for `request` (pure; the pool is only read). `anchors`: the prompt's
        reply anchors, found here if not given (exact mode). Only state computed under the
        request's rope is resumed; the decision says the rope (`Decision.rope`)."""
        scaling = self.scaling(request)
        view = RequestView(request.request_id, request.prompt_ids, request.prompt_text,
                           self.namespace(request), request.identity,
                           tuple(seg.hash for seg in prompt_segments) if prompt_segments is not None
                           else chain(request.prompt_ids, self.openers),
                           None if self.mode != "exact"
                           else anchors if anchors is not None else find_anchors(request.prompt_ids, self.reply_header),
                           rope=scaling.name, rope_reason=scaling.reason)
        planned = self.parking.plan(view, self.affinity, self.longest_prefix)
        return replace(planned, decision=replace(planned.decision, rope=scaling.name))

    def generate(self, request: GenerationRequest, emit: Callable[[str | TokenLogprob], None],
                 cancelled: Callable[[], bool],
                 on_decision: Callable[[Decision], None] | None = None) -> Completion:
        """Run `request` to completion, calling `emit` with each text delta (and, where the
        request asks for logprobs, each generated token's TokenLogprob before its text):
        `admit` it, then `step` until it is done (alongside any other flight admitted before).

        Blocking, for drivers in process (benches, tests); the server goes through `admit`
        and `step` (memrad.scheduler). Call from the engine's single worker thread. `cancelled`
        is polled between prefill chunks and before every decode step; `on_decision` hears the
        reuse decision before any prefill work starts.
        """
        flight = self.admit(request, emit, cancelled, on_decision)
        while flight.completion is None and flight.error is None:
            self.step()
        if flight.error is not None:
            raise flight.error
        return flight.completion

    @property
    def flights(self) -> tuple[Flight, ...]:
        """The requests in flight, in admission order."""
        return tuple(self._flights)

    def has_room(self) -> bool:
        return len(self._flights) < self.max_batch

    def holds(self, request: GenerationRequest) -> bool:
        """Check before `admit` (engine thread): True while `request` should stay queued
        because a flight still prefilling the prompt it extends (a retry, a reconnecting
        client) will reach the cut it forks at, and nothing parked offers as much: admitted
        then, it forks that state instead of priming the same tokens beside it
        (memrad.engine.attaching). False when nothing is in flight."""
        if self.attacher is None or not self._flights:
            return False
        hold = self.attacher.held(request)
        if hold is None:
            anchors = find_anchors(request.prompt_ids, self.reply_header)
            found = self.attacher.source(request, anchors, self._flights, self.scaling(request).name)
            if found is None or self.attacher.ready(*found):
                return False
            if found[1] <= self.plan(request, anchors=anchors).decision.reused_tokens:
                return False
            hold = self.attacher.hold(request, *found)
            log.info("%s waits for %s's prefill (at %d of %d) to pass %d", request.request_id,
                     hold.attachment.source_id, hold.attachment.at, hold.attachment.source_tokens,
                     hold.attachment.target)
        return self.attacher.waits(hold, self._flights)

    def admit(self, request: GenerationRequest, emit: Callable[[str | TokenLogprob], None],
              cancelled: Callable[[], bool], on_decision: Callable[[Decision], None] | None = None) -> Flight:
        """Plan `request`, check out the state it resumes from and put it in flight (engine
        thread; `has_room` first). Its prefill and decode run in later `step`s."""
        assert self.has_room(), f"{len(self._flights)} requests in flight, max_batch {self.max_batch}"
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
        hold = self.attacher.take(request) if self.attacher is not None else None
        planned = self.plan(request, prompt_segments, anchors)
        checking_out = time.perf_counter()
        live = self._live_fork(request, anchors, planned, hold)
        if live is not None:
            decided, cache, pre = live
            candidate = self.parking.get(decided.decision.candidate)
        else:
            decided = self.parking.load(planned, replan=lambda: self.plan(request, prompt_segments, anchors))
            if hold is not None:  # its source ended before the cut: what it parked is in the plan
                decided = replace(decided, decision=replace(decided.decision,
                                                            reason=hold.attachment.ended(decided.decision.reason)))
            candidate = self.parking.get(decided.decision.candidate)  # before a replace takes it out of the pool
            cache, pre = self.parking.check_out(decided, anchors)
        # What the resume cost before any priming (memrad.protocol.Decision.render_cost).
        decided = replace(decided, decision=replace(decided.decision, copied_bytes=pre.copied_bytes,
                                                    checkout_s=time.perf_counter() - checking_out))
        try:
            # The step is chosen before the decision leaves, so the reply's first bytes say it;
            # it never changes what is reused (exact mode parks no decoded KV).
            # A native-rope request decodes (and verifies drafts) on the native twins of the steps.
            native = decided.decision.rope == "native" and self.rope_rule.per_conversation
            step, make_feed = self._choose_step(cancelled, native)
            decision = replace(decided.decision, step=step)
            log.info("%s %s; %s; decode: %s step; rope: %s", request.request_id, decision.render(),
                     decision.render_cost(), step, decision.rope)
            if on_decision is not None:
                on_decision(decision)
            self.events(lambda: decision_event(self.loaded.tokenizer, self.openers, request, decision,
                                               prompt_segments, candidate))
            feed = make_feed()
            assert feed.step == step, (feed.step, step)
            speculating = speculation.plan(self.options.speculate, self.decoder, feed, native)
            parent = decided.session  # a resume that replaces it takes its drafts' index (memrad.reuse.drafts)
            if isinstance(speculating, speculation.Speculating) and parent is not None and not decided.fork \
                    and parent.drafts is not None:
                speculating.resume(parent.drafts)
            spans = prefill_spans(pre.start, checkpoint, self.prefill_chunk, self.mode == "exact", pre.anchors)
            flight = Flight(request, emit, cancelled, decided, cache, pre, spans,
                            self._snapshotter(cache, pre, checkpoint), feed, self._sampling,
                            prompt_segments, max_tokens, started, self.loaded.device,
                            speculating)
        except BaseException:
            self.parking.resume_failed(decided)
            raise
        self._flights.append(flight)
        self._report(flight)
        return flight

    def _live_fork(self, request: GenerationRequest, anchors: tuple[int, ...], planned: Plan,
                   hold: Hold | None) -> tuple[Plan, Any, Prefilled] | None:
        """Fork a flight's live state where it reuses more than the pool's plan: the plan, the
        forked cache and its Prefilled; None to go with the pool."""
        rope = self.scaling(request).name
        found = self.attacher.source(request, anchors, self._flights, rope) if self.attacher is not None else None
        if found is None or not self.attacher.ready(*found) or found[1] <= planned.decision.reused_tokens:
            return None
        source, target = found
        at = hold.attachment.at if hold is not None and hold.source is source else source.pre.primed_to
        attachment = Attachment(source.request.request_id, len(source.request.prompt_ids), at, target)
        primed = len(request.prompt_ids) - target
        decision = Decision(request.request_id, "resumed", attachment.forked(primed), target, primed, tier="live",
                            checkpoint=target, rope=rope)
        return (Plan(decision, checkpoint=target, fork=True), self.attacher.fork(source, target),
                Prefilled(target, target, {}, anchors))

    def flight_infos(self) -> list[FlightInfo]:
        """The requests on the model now, in admission order (the control snapshot)."""
        return [flight.info() for flight in tuple(self._flights)]

    def _report(self, flight: Flight) -> None:
        """Publish a FlightEvent when the flight changed phase, ran a prefill chunk, or
        decoded REPORT_EVERY tokens since the last one (bounded: a few events per second)."""
        now = (flight.phase, flight.tokens_so_far)
        last = flight.reported
        if last is not None and last[0] == now[0] and (now[0] == "decode" and now[1] - last[1] < REPORT_EVERY
                                                       or now[1] == last[1]):
            return
        flight.reported = now
        self.events(lambda: FlightEvent(time.time(), flight.info()))

    def step(self) -> list[Flight]:
        """One iteration of the scheduler: one decode step for every decoding flight (one token
        each, batched where their step batches), then prefill chunks of one flight still
        prefilling, up to `prefill_budget` tokens: the one that prefilled least recently (a new
        one first), so a short prompt is not stuck behind a long one and none starves. Flights that ended are parked and
        returned (`completion` or `error` set)."""
        decoding = [f for f in self._flights if f.phase == "decode" and f.pending is not None]
        phase = "batch" if len(decoding) > 1 else "decode"
        threads, started_s = (self.team.size_for(phase), self.team.now()) if decoding else (0, 0.0)
        for feed, group in _by_feed(decoding):
            try:
                if isinstance(feed, BatchStep):
                    for start in range(0, len(group), feed.rows):
                        self._batched_step(feed, group[start : start + feed.rows])
                else:
                    for flight in group:
                        self._one_row_step(feed, flight)
            except Exception as exc:  # a step that fails fails the requests it was computing
                for flight in group:
                    if flight.phase != "done":
                        flight.fail(exc)
        if decoding:
            self.team.ran(phase, threads, len(decoding), started_s)
        prefilling = min((f for f in self._flights if f.phase == "prefill"), key=lambda f: f.prefilled_at, default=None)
        if prefilling is not None:
            self._steps += 1
            prefilling.prefilled_at = self._steps
            threads, started_s = self.team.size_for("prefill"), self.team.now()
            try:
                with self.loaded.products.context(), self._rope_of(prefilling):  # model.products: any count
                    ran = prefilling.prefill(self.loaded.model, self.prefill_budget)
                if ran:
                    self.team.ran("prefill", threads, ran, started_s)
            except Exception as exc:
                prefilling.fail(exc)
        ended = [f for f in self._flights if f.phase == "done"]
        for flight in ended:
            self._flights.remove(flight)
            self._finish(flight)
        for flight in (*self._flights, *ended):
            self._report(flight)
        return ended

    def _rope_of(self, flight: Flight) -> Any:
        """The block a flight's model forwards run in: its rope in force (memrad.engine.model.rope)."""
        switch = self.loaded.rope
        return switch.under(flight.decided.decision.rope) if switch is not None else nullcontext()

    def _batched_step(self, feed: BatchStep, flights: list[Flight]) -> None:
        """One step of `feed` for up to feed.rows flights: each feeds its pending token, and
        those that speculate their drafts after it in the rows the others leave free, shared
        evenly (memrad.engine.speculation). Which rows a flight gets changes its speed only: a
        row's bits do not depend on its neighbours."""
        free = feed.rows - len(flights)
        runs: dict[int, list[int]] = {}
        self._rotation += 1  # who drafts first turns round, so no flight starves of free rows
        for turn in range(len(flights)):
            index = (turn + self._rotation) % len(flights)
            runs[index] = speculation.drafts_for(flights[index], -(-free // (len(flights) - turn)))
            free -= len(runs[index])
        runs = [runs[index] for index in range(len(flights))]
        rows = len(flights) + sum(map(len, runs))
        if rows == 1 and feed.alone is not None:  # the same bits, no pad rows
            flight = flights[0]
            return speculation.take_run(flight, feed.alone(flight.cache, flight.pending, flight.position)[None], [])
        logits = feed.fitting(rows).runs([f.cache for f in flights], [[f.pending, *d] for f, d in zip(flights, runs)],
                                         [f.position for f in flights])
        for flight, drafts, run in zip(flights, runs, logits):
            speculation.take_run(flight, run, drafts)

    def _one_row_step(self, feed: Any, flight: Flight) -> None:
        """One decode step of a flight on a one-row step: its pending token alone, or with its
        drafts as a run on the multi-row step whose rows have that step's bits."""
        drafting = flight.speculating
        drafts = speculation.drafts_for(flight, drafting.length.most) if drafting is not None else []
        step = drafting.step_for(1 + len(drafts)) if drafts else None
        if step is None:
            return speculation.take_run(flight, feed(flight.cache, flight.pending, flight.position)[None], [])
        speculation.take_run(flight, step.runs([flight.cache], [[flight.pending, *drafts]], [flight.position])[0], drafts)

    def _choose_step(self, cancelled: Callable[[], bool], native: bool = False) -> tuple[str, Callable[[], Any]]:
        """The step a new flight decodes with, from its first token to its last: the batched
        step (memrad.engine.decode.batch) where max_batch > 1 and the model has one, else
        the decoder's one-row step (flights then run one after another in each iteration).
        Returns its name (compiled, eager, transformers) and how to make it (memrad.engine.decode.
        decoder.Decoder.choose); under compile = wait it waits for the compiled step, at
        admission. Admitted beside another request, it asks for the batched packages (built
        in the background the first time; this request decodes as before meanwhile). `native`:
        the step's native twin (memrad.engine.decode.native)."""
        # A second request beside another, or one that speculates (its runs ride the batched step): the
        # batched packages are wanted.
        if self._batches() and (self._flights or self.options.speculate == "auto"):
            self.decoder.want_batch()
        return self.decoder.choose(self.decoder.batch_rows if self._batches() else None, cancelled, native)

    def _finish(self, flight: Flight) -> None:
        """Park a flight that ended and publish its turn; on an error, give its state back."""
        request, decided, cache, pre, out = flight.request, flight.decided, flight.cache, flight.pre, flight.out
        if flight.error is not None:
            self.parking.resume_failed(decided)
            return
        try:
            checkpoint = len(request.prompt_ids)
            fed = tuple(out.generated[: out.num_fed])
            completion = Completion(
                text=out.text, finish_reason=out.finish, prompt_tokens=checkpoint,
                completion_tokens=len(out.generated), cached_tokens=pre.start, ttft_s=out.ttft_s,
                total_s=time.perf_counter() - flight.started,
                decision=replace(decided.decision, ttft_s=out.ttft_s, step=flight.feed.step), stop_sequence=out.stop_sequence,
                logprobs=tuple(out.logprobs) if request.sampling.logprobs is not None else None,
                error=out.error,
                speculation=flight.speculation(),
            )
            token_ids = tuple(request.prompt_ids[: pre.primed_to]) + fed
            drafts = flight.speculating.parked_index(token_ids) if flight.speculating is not None else None
            session = self.parking.park(request, self.namespace(request), decided, cache, pre, fed, out.text,
                                        flight.prompt_segments, drafts)
        except Exception as exc:  # as before batching: the request fails, its state is not parked
            flight.error = exc
            return
        flight.completion = completion
        spec = completion.speculation
        if spec is not None and spec.on:
            self._drafts_so_far = tuple(a + b for a, b in zip(self._drafts_so_far, (
                spec.drafted_tokens, spec.accepted_tokens, spec.decode_steps, spec.fed_tokens)))
        self.events(lambda: TurnEvent(
            at=time.time(), request_id=request.request_id, conversation=session.session_id if session else None,
            identity=request.identity.name if request.identity else None, prompt_tokens=checkpoint,
            cached_tokens=pre.start, completion_tokens=len(out.generated), ttft_s=out.ttft_s,
            outcome=decided.decision.outcome, finish_reason=out.finish,
            total_s=completion.total_s, step=flight.feed.step, speculation=completion.speculation))
        self._hand_on(FinishedState(
            request=request, cache=cache, cache_token_ids=token_ids,
            generated_ids=tuple(out.generated), prompt_checkpoint=pre.primed_to,
            committed_text=request.prompt_text + out.text, completion=completion,
            prompt_logits=out.prompt_logits, session=session))

    def _shaper(self, request: GenerationRequest, logits: torch.Tensor) -> Shaper | None:
        """The request's logits shaping, from its own tokens and its grammar's fresh matcher:
        the same in a cold and a resumed run, and after the step on every decode path."""
        params = request.sampling
        if not shapes(params):
            return None
        matcher = self.chat.grammars.matcher(params.constraint) if params.constraint is not None else None
        return Shaper(params, request.prompt_ids, logits.numel(), self.loaded.eos_ids, matcher)

    def _snapshotter(self, cache: Any, pre: Prefilled, prompt_len: int) -> Snapshotter:
        """Clone non-croppable state at the essential positions and at each reply anchor below
        P (boundary checkpoints) as prefill passes them."""
        wanted: set[int] = set()
        if not is_croppable(cache):
            wanted = essential(prompt_len, self.prefill_chunk, pre.anchors, self.mode) | {a for a in pre.anchors if a < prompt_len}
        return Snapshotter(cache, pre, wanted)

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


def _team_policy(options: EngineOptions, products: Products) -> TeamPolicy:
    """Fixed at options.threads, or following the CPU actually free from at most that. In exact
    mode prefill adapts only where its products give the same bits at any count."""
    if not options.adapt_threads:
        return TeamPolicy(Ceiling(options.threads, "set by model.threads"), fixed=options.threads)
    steady = None
    if options.mode == "exact" and products.slices is None:
        steady = {"prefill": f"exact mode keeps the count it started with: prefill products follow the count "
                             f"({products.choice.reason}), and a resumed prefill must give a cold one's bits"}
    return TeamPolicy(_capped(cpu_ceiling(), options.threads), now_s=time.monotonic(), steady=steady)


def _capped(ceiling: Ceiling, threads: int) -> Ceiling:
    return ceiling if ceiling.cpus <= threads else Ceiling(threads, f"at most {threads} threads asked")


def _by_feed(flights: list[Flight]) -> list[tuple[Any, list[Flight]]]:
    """Decoding flights grouped by the step they decode with, in admission order."""
    groups: dict[int, tuple[Any, list[Flight]]] = {}
    for flight in flights:
        groups.setdefault(id(flight.feed), (flight.feed, []))[1].append(flight)
    return list(groups.values())
