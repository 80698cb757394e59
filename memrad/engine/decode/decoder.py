"""What the engine runs for each generated token, and why that one.

    compile = auto   the eager step (memrad.engine.decode.steps.llama) at once, the compiled one built
                     in the background; requests that start after it is ready decode compiled
                     (the daemon answers meanwhile, no reply waits for the build)
    compile = wait   as auto, but a reply waits for the build (or its failure) before it decodes,
                     so every start's replies are the same bits
    compile = on     compiled before the daemon answers; a failure stops the start
    compile = off    the step, eager, with torch's attention: the A/B arm of the compiled one

Compiled means an AOTInductor package (memrad.engine.decode.package) that attends with memra's
CPU kernel (memrad.engine.kernels.decode_attention): built once per machine, model and torch (in a
child process when the engine gives a recipe, so this interpreter keeps serving:
memrad.engine.decode.builder) and opened by
every later start before it serves. torch.compile is the fallback where AOTInductor fails.
Models the step does not cover, and caches that are not in-place slabs (CUDA), decode with
transformers' forward; no C++ compiler or a failed compile (auto) leaves the eager step. Every
choice carries a reason (/health, `memrad status`, the log).

Compiled and eager steps are not bit-identical to each other (inductor fuses the elementwise
work and rounds once where eager rounds each op; emulating eager's casts was measured and still
differs: docs/ARCHITECTURE.md, "The decode step"). What that can change is a reply, never parked
state: in exact mode decoded KV is never reused (DESIGN: Exactness), so the state a turn parks
does not depend on the step its reply decoded with. So under auto no reply waits: a request
decodes on the best step open when it is admitted (eager until the compiled one lands), that
one from its first token to its last (`feeder()` hands it over once, as a `OneRowFeed` naming
it), and the reply says which (`step`: the decision record's field, the `x-memra-step`
header). A resumed turn equals a cold one under the same step. Who wants every start's replies
bit-identical sets compile = wait: `feeder()` then waits for the build, so a first start
answers with the very step every later start opens. `memrad pull` builds the package
(`prepare()`), so a first start after a pull serves compiled from its first reply.

With `batch_rows` (max_batch, `batch_decode = "batched"`), the batched step
(memrad.engine.decode.batch) is compiled too, one package per row count of `batch_sizes`
(2 and max_batch: two requests do not pay for two pad rows; with speculation, `run_rows` too:
one request's drafts verified as rows of one step), opened beside the one-row one.
Under auto and wait they are built only when a second request first decodes beside another
(`want_batch()`, after the one-row step: a single agent never pays for them; `memrad pull`
still builds them ahead); `batch_step()` hands a request the compiled ones once they are
open, and the one-row step meanwhile. Each build says what it builds and how long the last
one like it took here (memrad.engine.decode.build_times), in the log and in `choices`.

Why it compiles this way, and what was tried and dropped: docs/ARCHITECTURE.md, "The decode
step". Measured: docs/BENCHMARKS.md, Decode and Startup and compile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memrad.engine.decode import build_times, builder, native as native_steps
from memrad.engine.decode import package as step_package
from memrad.engine.decode.batch import BatchGraph, BatchStep
from memrad.engine.decode import steps
from memrad.engine.decode.steps import new_step, support
from memrad.engine.decode.steps.llama import DecodeStep, attended_rows
from memrad.engine.forward import decode_one_token
from memrad.engine.kernels import decode_attention
from memrad.engine.kernels.build import cxx_compiler
from memrad.engine.model import kv_dtype
from memrad.engine.model.hardware import Choice
from memrad.engine.state.kv import MAX_RESERVED_TOKENS, all_slabs, reserve

log = logging.getLogger("memrad.engine")

COMPILE_MODES = ("auto", "wait", "on", "off")
BACKGROUND = ("auto", "wait")  # the modes that build on a background thread while the daemon serves
# What /health says while the step builds in the background, under wait and under auto.
_WAITS = "compile = wait: replies wait for the compiled step"
_SERVES_EAGER = ("compile = auto: new requests decode on the eager step until the compiled step is ready, "
                 "each on the step it started on to its last token")
_ON_DEMAND = Choice("on demand", "built when a second request first decodes beside another (`memrad pull` builds "
                                 "them ahead); until then each request decodes on the one-row step")


class CompileFailed(RuntimeError):
    """`compile = on` and torch.compile could not build the decode step; says what to do."""


Feed = Callable[[Any, int, int], torch.Tensor]  # (cache, token id, position) -> logits [V] float32


@dataclass(frozen=True, eq=False)
class OneRowFeed:
    """One request's one-row step for its whole reply, and which it is: "compiled", "eager" or
    "transformers" (the reply's `step`)."""

    step: str
    run: Feed
    kernel: bool = False  # attends with memra's kernel (the multi-row step speculation verifies on matches it)

    def __call__(self, cache: Any, token_id: int, position: int) -> torch.Tensor:
        return self.run(cache, token_id, position)


def _attention(kernel: bool, why_not: str | None = None) -> str:
    return "memra's attention kernel" if kernel else "torch's attention" + (f" ({why_not})" if why_not else "")


def said_sizes(sizes: tuple[int, ...], last: str = "and") -> str:
    """Row counts as a person reads them: "2 and 4", "2, 4 and 8"."""
    words = [str(size) for size in sizes]
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else "".join(words)


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


class Decoder:
    """Chooses and builds the decode step; `feeder()` hands a request the current one.

    `choice.value` is "compiled", "compiling", "eager" or "transformers", with the reason.
    """

    def __init__(self, model: Any, context_len: int, device: torch.device, mode: str = "off",
                 recipe: builder.Recipe | None = None, batch_rows: int | None = None,
                 run_rows: int | None = None) -> None:
        assert mode in COMPILE_MODES, mode
        self.model = model
        self.mode = mode
        self.recipe = recipe  # given: the package is built in a child process (builder.build_in_child)
        self._start_lock = threading.Lock()  # the daemon's start and a waiting reply's, once
        self.capacity = min(context_len, MAX_RESERVED_TOKENS)  # the slabs' rows (memrad.engine.state.kv)
        self.compile_s: float | None = None
        self._thread: threading.Thread | None = None
        self._warming: threading.Thread | None = None  # `warm_batch`'s thread
        self._started = False
        self._one_row_building = False  # the background thread is building the one-row step
        self._batch_wanted = False  # a second request decoded beside another: build the batched step
        self._closed = False
        # (step, attend with memra's kernel), read and replaced as one, so a request never
        # pairs one step with the other's attention; no step: transformers decodes.
        self.current: tuple[Any, bool] = (None, False)
        self._batched: dict[tuple[int, bool, bool], BatchStep] = {}  # (rows, kernel, compiled) -> the batched step
        self._batch_lock = threading.Lock()  # one maker of a batched step at a time (`warm_batch`, the engine)
        self._verify: dict[tuple[int, bool], BatchStep | None] = {}  # (rows, kernel) -> speculation's step, checked
        # The batched step compiled beside the one-row step (a step with a batched twin, memra's kernel):
        # its packages are built and opened with the one-row one, and `batch_choice` says how it went.
        # `batch_rows`: the requests decoding together (max_batch); `run_rows`: the rows one request's
        # speculated run may take (memrad.engine.speculation.RUN_ROWS), where more. A request holds the
        # step of the most rows, and each step runs the smallest twin that holds its rows (`batch_sizes`).
        self.batch_rows = max(batch_rows, run_rows or 0) if batch_rows and batch_rows > 1 else None
        self._group_rows = batch_rows
        self.batch_packages: dict[int, step_package.PackagedBatch] = {}  # rows -> the package
        self.batch_choice = Choice("eager", "no batched step asked for")
        # Served past the native length: native requests decode on twins of the steps with the
        # native rope's tables (memrad.engine.decode.native); None where there is one rope.
        self.switch = native_steps.switch_of(model)
        self.native: native_steps.NativeSteps | None = None
        unsupported = support(model, context_len) if device.type == "cpu" else (
            "the step runs over CPU slabs; CUDA decodes with transformers' forward")
        if unsupported is not None:
            self.choice = Choice("transformers", unsupported)
            if mode == "on":
                raise CompileFailed(f"compile = on, but {unsupported}: set compile = auto or off")
            return
        self.eager = new_step(model, context_len)
        if self.switch is not None and isinstance(self.eager, DecodeStep):
            self.native = native_steps.NativeSteps(self.switch, model, self.eager, context_len, self.capacity)
        if self.batch_rows and not steps.has_batched(self.eager):
            self.batch_rows = None  # the hybrids: no batched step, one row at a time
        elif self.batch_rows and not isinstance(self.eager, DecodeStep):
            self.batch_rows = self._group_rows  # Gemma, LFM2: no run's rows to cut back, no speculation
        if self.batch_rows:
            self.batch_choice = Choice("eager", f"compile = {mode}: the eager batched step"
                                       + (" (compiled with the one-row step)" if mode != "off" else ""))
        # A kernel built by an earlier start loads in milliseconds: the eager step uses it while the
        # compile runs. compile = off keeps torch's attention (the reference the tests hold steps to)
        # unless the rows are bf16 under fp32 activations (memrad.engine.model.kv_dtype), which the
        # kernel reads as they are and torch's attention only through a widened copy of every row.
        widened = kv_dtype.of(model) != model.dtype
        kernel = (mode in BACKGROUND or widened) and decode_attention.load(cxx_compiler(), build_missing=False) is None
        self.current = (self.eager, kernel)
        self.choice = Choice("eager", f"compile = off: {_attention(kernel)}" if mode == "off"
                             else f"compile = {mode}: not started; {_attention(kernel)}")

    @property
    def step(self) -> Any:
        """The step (memrad.engine.decode.steps), or its compiled form once ready; None when
        transformers decodes."""
        return self.current[0]

    def start(self) -> None:
        """Begin compiling as the mode says: now (on), on a background thread (auto, wait). Once.
        A package an earlier start built is opened at once under either mode."""
        with self._start_lock:
            if self.mode == "off" or self.step is None or self._started:
                return
            self._started = True
            if self._open_package():
                return
            if self.step is not self.eager:  # the one-row step opened: only the batched one is left
                if self.mode == "on":
                    self._compile_batch(self.current[1])
                else:  # built when a second request first wants it (`want_batch`)
                    self.batch_choice = _ON_DEMAND
                return
            if self.mode == "on":
                self._compile()
                if isinstance(self.step, step_package.PackagedStep):
                    self._compile_batch(self.current[1])
                return
            self.choice = Choice("compiling", _WAITS if self.mode == "wait" else _SERVES_EAGER)
            if self.batch_rows:
                self.batch_choice = _ON_DEMAND
            self._one_row_building = True
            self._thread = builder.start_thread(self._compile_in_background)

    def want_batch(self) -> None:
        """A second request is admitted beside another (auto, wait): build the batched step's
        packages now in the background, once, unless they are open, cannot be built (no
        kernel, the one-row step not compiled) or the one-row build is still running (it
        builds them when it lands). Returns at once; requests meanwhile decode as before."""
        if not self.batch_rows or self.mode not in BACKGROUND:
            return
        with self._start_lock:
            if self._batch_wanted:
                return
            self._batch_wanted = True
            if self._one_row_building or not self._can_batch():
                return
            self._thread = builder.start_thread(lambda: self._compile_batch(self.current[1]))

    def _can_batch(self) -> bool:
        """The one-row step is a package and a batched size is still to build (sets
        `batch_choice` to say it is building)."""
        if not isinstance(self.step, step_package.PackagedStep) or not self._wants_batch(self.current[1]):
            return False
        self.batch_choice = Choice("compiling", "a second request decodes beside another: building the "
                                   f"{said_sizes(self.batch_sizes)}-row packages; each request on "
                                   "the one-row step until they are open")
        return True

    def _compile_in_background(self) -> None:
        """The one-row step, then the batched one if a second request wanted it meanwhile."""
        try:
            self._compile()
        finally:
            with self._start_lock:
                self._one_row_building = False
                if self.batch_rows and not isinstance(self.step, step_package.PackagedStep):
                    self.batch_choice = Choice("eager", f"the one-row step is {self.choice.value}: "
                                                        "the eager batched step")
                build = self._batch_wanted and not self._closed and self._can_batch()
        if build:
            self._compile_batch(self.current[1])

    def prepare(self, say: Callable[[build_times.Progress], None] = lambda _: None) -> str:
        """Build the packages now unless the compile cache has them, as a start would (in a
        child when there is a recipe), the batched ones too (a start builds those only when
        a second request wants them), and say what happened (`memrad pull`); `say` hears each
        build as it starts, with its estimate. Never raises, and never falls back to
        torch.compile, which leaves nothing a start opens."""
        if self.step is None:
            return f"not compiled: {self.choice.reason}"
        if self._open_package():
            return f"already built: {self._package(self.current[1]).name}"
        compiler = cxx_compiler()
        if compiler is None:
            return "not built: no C++ compiler (install g++, e.g. `apt install g++`)"
        kernel = decode_attention.load(compiler) is None
        said = []
        for rows in (None, *self.batch_sizes) if self.batch_rows and kernel else (None,):
            path = self._package(kernel, rows)
            if path.is_file():
                said.append(f"already built: {path.name}")
                continue
            started = time.perf_counter()
            try:
                self._build_package(kernel, rows, say)
            except Exception as exc:  # export and inductor raise many types; a start tries again
                return "; ".join([*said, f"not built ({type(exc).__name__}: {_first_line(exc)}); a start compiles it"])
            said.append(f"built {path.name} in {time.perf_counter() - started:.0f} s, {_attention(kernel)}")
        return "; ".join(said)

    def _build_package(self, kernel: bool, rows: int | None = None,
                       say: Callable[[build_times.Progress], None] | None = None) -> Path:
        """Build one package, saying what and how long the last such build took here, then
        each phase it reaches (`say` hears the Progress each time); keep this one's time for
        the next estimate."""
        path = self._package(kernel, rows)
        progress = build_times.Progress(f"the decode step ({f'{rows} rows' if rows else 'one row'}, "
                                        f"{_attention(kernel)})", build_times.last_build_s(path))
        log.info("building %s: %s", progress.what, build_times.estimate_of(progress.estimate_s))
        if say is not None:
            say(progress)

        def reached(phase: str) -> None:
            nonlocal progress
            progress = replace(progress, phase=phase)
            log.debug("building %s: %s", progress.what, phase)
            if say is not None:
                say(progress)

        started = time.perf_counter()
        builder.build_package(self.recipe, self.eager, self.model.config, self.capacity, kernel, path, rows, reached)
        build_times.record(path, time.perf_counter() - started)
        return path

    def compiling(self) -> bool:
        """A background compile is still running."""
        return self._thread is not None and self._thread.is_alive()

    def running_torch(self) -> bool:
        """A thread of this decoder is still running torch in this process: a compile, or
        `warm_batch`'s checks (memrad.daemon's exit: teardown under either aborts in C++)."""
        return self.compiling() or (self._warming is not None and self._warming.is_alive())

    def close(self) -> None:
        """Stop a package build still running in its child process (at `memrad stop`); the
        compile thread then ends without trying torch.compile."""
        self._closed = True
        if self.compiling():
            log.info("stopped while compiling the decode step: the next start compiles again")
        builder.stop_children()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a background compile has finished (benchmarks, tests)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _package(self, kernel: bool, rows: int | None = None) -> Path:
        directory = Path(builder.compile_cache_dir())
        return step_package.package_path(self.eager, self.model.config, self.capacity, kernel, directory, rows)

    def _open_package(self) -> bool:
        """Open the packages an earlier start built: with memra's attention kernel when that is
        built (the packages call it by name), else the one with torch's attention; True when
        nothing is left to build (the one-row step, and the batched one where it is asked for)."""
        started = time.perf_counter()
        try:
            kernel = decode_attention.load(cxx_compiler(), build_missing=False) is None
            path = self._package(kernel)
            if not path.is_file():
                return False
            step = step_package.load(self.eager, self.capacity, kernel, path)
        except Exception as exc:  # damaged, or unreadable by this torch: compile again
            log.warning("cannot open the decode step's package (%s: %s): compiling again",
                        type(exc).__name__, _first_line(exc))
            return False
        self._ready(step, kernel, f"AOTInductor package from the compile cache ({path.name}), "
                                  f"{_attention(kernel)}", started)
        log.info("decode step opened from %s in %.2f s", path, self.compile_s)
        return not self._wants_batch(kernel) or self._open_batch(kernel)

    def _wants_batch(self, kernel: bool) -> bool:
        if self.batch_rows and not kernel:
            self.batch_choice = Choice("eager", "the batched step compiles with memra's attention kernel only "
                                                "(not built here): the eager batched step")
        return bool(self.batch_rows) and kernel and len(self.batch_packages) < len(self.batch_sizes)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batched step's row counts: 2, max_batch and a speculated run's rows (a step of n
        rows runs on the smallest that holds them; one request alone on the one-row step)."""
        return tuple(sorted({2, self._group_rows, self.batch_rows})) if self.batch_rows else ()

    @property
    def batch_package(self) -> step_package.PackagedBatch | None:
        """The package of the most rows (`batch_rows`), once open."""
        return self.batch_packages.get(self.batch_rows) if self.batch_rows else None

    def _open_batch(self, kernel: bool) -> bool:
        """Open the batched step's packages an earlier start or `memrad pull` built; True
        when every size is open."""
        for rows in self.batch_sizes:
            path = self._package(kernel, rows)
            if rows in self.batch_packages:
                continue
            try:
                if not path.is_file():
                    return False
                self.batch_packages[rows] = step_package.load_batch(self.eager, self.capacity, rows, path)
            except Exception as exc:  # damaged, or unreadable by this torch: compile again
                log.warning("cannot open the batched step's package (%s: %s): compiling again",
                            type(exc).__name__, _first_line(exc))
                return False
            log.info("batched decode step (%d rows) opened from %s", rows, path)
        names = ", ".join(self._package(kernel, rows).name for rows in self.batch_sizes)
        sizes = said_sizes(self.batch_sizes)
        self.batch_choice = Choice("compiled", f"AOTInductor packages ({names}), {sizes} rows")
        return True

    def _compile_batch(self, kernel: bool) -> None:
        """Build and open the batched step's package (after the one-row step: that one serves
        max_batch 1 and every model). A failure leaves the eager batched step, said in `batch_choice`."""
        if not self._wants_batch(kernel) or self._open_batch(kernel):
            return
        started = time.perf_counter()
        try:
            for rows in self.batch_sizes:
                if not self._package(kernel, rows).is_file():
                    self._build_package(kernel, rows)
        except Exception as exc:  # export and inductor raise many types; the eager batched step serves
            if self._closed:
                return
            why = f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("the batched step did not compile (%s): the eager batched step serves", why)
            self.batch_choice = Choice("eager", f"the batched step did not compile ({why})")
            return
        if self._open_batch(kernel):
            log.info("batched decode steps (%s rows) compiled in %.1f s",
                     said_sizes(self.batch_sizes), time.perf_counter() - started)

    def _compile(self) -> None:
        compiler = cxx_compiler()
        if compiler is None:
            why = "no C++ compiler for torch.compile (install g++, e.g. `apt install g++`)"
            if self.mode == "on":
                raise CompileFailed(f"compile = on, but {why}; or set compile = auto or off")
            self.choice = Choice("eager", f"{self.mode}: {why}")
            return
        started = time.perf_counter()
        no_kernel = decode_attention.load(compiler)
        kernel = no_kernel is None
        if not kernel:
            log.warning("decode attention: torch's (%s)", no_kernel)
        waiting = self.choice.reason if self.choice.value == "compiling" else None

        def building(progress: build_times.Progress) -> None:  # /health and `memrad status` say where it is
            if waiting is not None and self.choice.value == "compiling":
                at = f"{progress.phase} ({build_times.PHASES.index(progress.phase) + 1}/{len(build_times.PHASES)}), " \
                    if progress.phase in build_times.PHASES else ""
                self.choice = Choice("compiling", f"{waiting}; building the one-row step: {at}"
                                                  f"{build_times.estimate_of(progress.estimate_s)}")

        try:
            path = self._build_package(kernel, say=building)
            step = step_package.load(self.eager, self.capacity, kernel, path)
            how = f"AOTInductor ({compiler}), package built"
        except builder.BuildKilled as exc:  # killed from outside: tracing in-process would not help
            if self._closed:
                return
            if self.mode == "on":
                raise CompileFailed(f"{exc}; start again") from exc
            log.warning("%s: decoding with the eager step; the next start builds it again", exc)
            self.choice = Choice("eager", f"{self.mode}: {exc}; the next start builds it again")
            return
        except Exception as exc:  # export and inductor raise many types; try torch.compile
            if self._closed:
                return
            aoti_failed = f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("AOTInductor failed (%s): trying torch.compile", aoti_failed)
            try:
                step = builder.torch_compiled(self.eager, self.model.config, self.capacity, kernel)
            except Exception as exc:  # inductor raises many types; each means "cannot compile here"
                why = f"torch.compile failed ({type(exc).__name__}: {_first_line(exc)})"
                if self.mode == "on":
                    raise CompileFailed(f"{why}; set compile = auto or off to start with the eager step") from exc
                log.warning("%s: decoding with the eager step", why)
                self.choice = Choice("eager", f"{self.mode}: {why}")
                return
            how = f"torch.compile (inductor, {compiler}; AOTInductor failed: {aoti_failed})"
        self._ready(step, kernel, f"{how}, {_attention(kernel, no_kernel)}", started)
        log.info("decode step compiled in %.1f s (cache %s)", self.compile_s, os.environ["TORCHINDUCTOR_CACHE_DIR"])

    def _ready(self, step: Any, kernel: bool, how: str, started: float) -> None:
        self.compile_s = time.perf_counter() - started
        self.current = (step, kernel)  # requests that start from now on decode compiled
        self.choice = Choice("compiled", f"compile = {self.mode}: {how}, ready {self.compile_s:.1f} s after the model")

    # -- batched decode (memrad.engine.decode.batch): several requests' tokens in one step --

    @property
    def native_why(self) -> str | None:
        """None where a request can decode under the native rope (`choose(native=True)`), else why
        not: the model has one rope, or its step (Gemma 3, the hybrids) has tables of its own."""
        if self.switch is None:
            return "the model has one rope"
        if self.step is not None and self.native is None:
            return f"the {type(self.eager).__name__} decode step has one rope table"
        return None

    def choose(self, rows: int | None, cancelled: Callable[[], bool] = lambda: False, native: bool = False
               ) -> tuple[str, Callable[[], OneRowFeed | BatchStep]]:
        """The step a new request decodes with from its first token to its last, chosen now:
        its name ("compiled", "eager", "transformers"), said before the reply's first byte,
        and how to make it (the first batched step of a kind is checked on a scratch request,
        which takes a moment: the name must not wait for it). `rows`: the batched step of that
        many rows where there is one (`batch_step`), else None for the one-row step. What is
        open is read once, so a compile that lands in between changes neither. `native`: the
        step's twin under the native rope (memrad.engine.decode.native; `native_why` None)."""
        self._await_compile(cancelled, lambda: self.choice.value == "compiling")
        (step, kernel), package = self.current, self.batch_package
        if rows is not None and steps.has_batched(self.eager_step):
            compiled = package is not None and package.rows == rows
            if (step is not self.eager) == compiled:  # else: the one-row step compiled, the batched not yet
                if compiled or (rows, kernel, False) in self._batched or not self._batch_lock.locked():
                    return ("compiled" if compiled else "eager"), lambda: self._batch_step(rows, kernel, compiled,
                                                                                           native)
                # The eager batched step is being made and checked (`warm_batch`, a first start): this
                # request decodes on the one-row eager step rather than wait for the check.
        feed = self._one_row(step, kernel, native)
        return feed.step, lambda: feed

    def batch_step(self, rows: int, cancelled: Callable[[], bool] = lambda: False) -> BatchStep | None:
        """The batched step of `rows` rows a new request decodes with, or None where it
        decodes one row at a time on `feeder()`'s step: where this model has no batched step
        (the hybrids, transformers' forward), and while the one-row step is compiled
        and the batched one is not (its package is built after the one-row one): a batched
        row's bits are the compiled one-row step's, not the eager batched step's. The compiled
        one once its package is open (`batch_rows` rows), else the eager step's
        weights with the attention the current step uses. One BatchStep per (attention,
        compiled), so a request keeps its bits from first token to last. compile = wait waits
        for the one-row step's compile as `feeder()` does."""
        if not steps.has_batched(self.eager_step):
            return None
        feed = self.choose(rows, cancelled)[1]()
        return feed if isinstance(feed, BatchStep) else None

    def warm_batch(self, rows: int) -> None:
        """Make the eager batched step of `rows` rows now, on a background thread, while the
        one-row step is eager (a first start, compile = auto or off): its scratch-request
        checks took 13.5 s of a first reply's 15.4 s TTFT on a busy 2-core Xeon, and the
        daemon is idle until its first request. A request admitted meanwhile decodes on the
        one-row eager step, its whole reply (`choose`), rather than wait for the check."""
        if not steps.has_batched(self.eager_step) or self.mode == "wait" or self.step is not self.eager:
            return
        kernel = self.current[1]

        def make() -> None:
            try:
                self._batch_step(rows, kernel, False)
            except Exception:  # the engine makes it on demand instead, and fails its request there
                log.exception("making the eager batched step ahead of the first request failed")

        self._warming = threading.Thread(target=make, name="memrad-batch-check", daemon=True)
        self._warming.start()

    def _batch_step(self, rows: int, kernel: bool, compiled: bool, native: bool = False) -> BatchStep:
        with self._batch_lock:
            served = self._made_batch_step(rows, kernel, compiled)
            if not native:
                return served
            return self.native.batch(served, lambda size: self._package(kernel, size),
                                     self._one_row(*self.current, native=True))

    def _made_batch_step(self, rows: int, kernel: bool, compiled: bool) -> BatchStep:
        key = (rows, kernel, compiled)
        if key not in self._batched:
            batched = self._new_batch_step(rows, kernel, compiled)
            batched.alone = self._same_bits_alone(batched)  # both compiled, or both eager
            if batched.alone is not None:  # its smaller twins where their rows are the same bits too
                twins = [self._new_batch_step(size, kernel, compiled) for size in self.batch_sizes if size < rows]
                batched.smaller = [twin for twin in twins if self._same_bits_alone(twin) is not None]
            self._batched[key] = batched
        return self._batched[key]

    def verify_step(self, feed: OneRowFeed, rows: int, native: bool = False) -> BatchStep | None:
        """The eager batched step of exactly `rows` rows whose row gives a request on the eager
        one-row `feed` that feed's bits (with its attention), for speculation's runs
        (memrad.engine.speculation): checked once per (rows, attention, rope) against the
        one-row step, and to keep a run's rows in order (`runs_exact`); None where the bits
        differ (a matmul's row depends on M: fp32) or `feed` is not the eager step. `native`:
        its twin under the native rope (memrad.engine.decode.native), checked against the
        native one-row step."""
        if not isinstance(self.eager_step, DecodeStep) or feed.step != "eager" or (native and self.native is None):
            return None
        key = (rows, feed.kernel, native)
        with self._batch_lock:
            if key not in self._verify:
                made = self._new_batch_step(rows, feed.kernel, compiled=False)
                if native:
                    made = self.native.batch(made, lambda size: self._package(feed.kernel, size), None)
                alone = self._one_row(self.eager, feed.kernel, native)
                same = self._same_bits_alone(made, alone) is not None
                self._verify[key] = made if same and self.runs_exact(made) else None
        return self._verify[key]

    def runs_exact(self, step: BatchStep) -> bool:
        """Whether a run of rows on one slab (`BatchStep.runs`: row j attends the rows before it,
        written in the same step) gives each row the bits `step` gives it one row at a time:
        checked once per step on a scratch request (3 tokens primed, then `step.rows` tokens fed
        as one run and one by one, every logit). Holds on the eager graph by construction (each
        row writes, then attends, in order); on a compiled graph where its code writes every
        row's KV before the attention that reads it."""
        if step.runs_exact is None:
            from transformers import DynamicCache

            from memrad.engine.forward import prefill
            from memrad.engine.state.layers import install

            tokens = [4 + i for i in range(step.rows)]
            caches = []
            for _ in range(2):
                cache = install(DynamicCache(config=self.model.config), self.capacity, kv_dtype.of(self.model))
                prefill(self.model, cache, [1, 2, 3], 0, 256)
                caches.append(cache)
            together = step.runs([caches[0]], [tokens], [3])[0]
            apart = torch.cat([step.runs([caches[1]], [[token]], [3 + i])[0] for i, token in enumerate(tokens)])
            step.runs_exact = bool(torch.equal(together, apart))
            log.log(logging.INFO if step.runs_exact else logging.WARNING, "a run of %d rows on one slab (%s): %s",
                    step.rows, step.step, "each row's bits as fed one at a time" if step.runs_exact else
                    "the bits differ from rows fed one at a time: no speculation on this step")
        return step.runs_exact

    def _new_batch_step(self, rows: int, kernel: bool, compiled: bool) -> BatchStep:
        eager = BatchGraph(self.eager, kernel)
        # Pad rows' slabs: zero pages until written, one row each (memrad.engine.state.kv.reserve).
        scratch = [step_package.example_buffers(self.eager, self.model.config, self.capacity, 2, reserve)[:2]
                   for _ in range(rows - 1)]
        return BatchStep(self.batch_packages[rows] if compiled else eager, rows, kernel, scratch, eager, compiled)

    def _same_bits_alone(self, batched: BatchStep, alone: OneRowFeed | None = None) -> Feed | None:
        """The one-row feed where it gives a request the bits `batched` gives it, else None:
        checked on a scratch request (3 tokens primed, 3 decoded each way, every logit). Holds
        where the matmuls' rows do not depend on M (memrad.engine.decode.batch)."""
        from transformers import DynamicCache

        from memrad.engine.forward import prefill
        from memrad.engine.state.layers import install

        alone = alone or self.feeder()
        logits = []
        for feed in (alone, lambda cache, token, position: batched([cache], [token], [position])[0]):
            cache = install(DynamicCache(config=self.model.config), self.capacity, kv_dtype.of(self.model))
            prefill(self.model, cache, [1, 2, 3], 0, 256)
            logits.append([feed(cache, token, 3 + i).flatten() for i, token in enumerate((4, 5, 6))])
        same = all(torch.equal(a, b) for a, b in zip(*logits))
        log.log(logging.INFO if same else logging.WARNING, "batched decode, %d rows (%s): %s", batched.rows,
                "compiled" if batched.compiled else "eager",
                "a request decoding alone runs the one-row step (the same bits)" if same else
                "the one-row step's bits differ from a batched row's here: a request decoding alone runs padded, "
                "and one admitted before the batched step was ready keeps the one-row step's bits")
        return alone if same else None

    def _await_compile(self, cancelled: Callable[[], bool], pending: Callable[[], bool]) -> None:
        """compile = wait: wait until the step `pending` names has landed or failed (the
        compile started here if the daemon has not yet), or the request is cancelled."""
        if self.mode == "wait":
            self.start()
            while self.compiling() and pending() and not cancelled():
                self.wait(0.1)

    @property
    def eager_step(self) -> Any:
        return getattr(self, "eager", None)

    def feeder(self, cancelled: Callable[[], bool] = lambda: False) -> OneRowFeed:
        """The step one request decodes with, from its first token to its last: the best one
        open now (compile = auto never waits; a compile that lands mid-reply serves the requests
        admitted after it). compile = wait: waits until the compile has landed or failed
        (started here if the daemon has not yet), so no reply decodes with a step a later start
        would not use; a request cancelled meanwhile (a hang-up, `memrad stop`) stops waiting
        and is ended by its caller."""
        return self.choose(None, cancelled)[1]()

    def _one_row(self, step: Any, kernel: bool, native: bool = False) -> OneRowFeed:
        if native:  # the step's twin under the native rope, its name said as it is
            served = self._one_row(None, kernel)
            if step is not None:
                twin = self.native.one_row(step, kernel, self._package(kernel))
                served = self._one_row_on(twin, kernel, twin.eager if isinstance(twin, step_package.PackagedStep)
                                          else twin, "eager" if twin is self.native.eager else "compiled")
            return OneRowFeed(served.step, native_steps.under_native(self.switch, served.run), served.kernel)
        if step is None:
            return OneRowFeed("transformers", lambda cache, token_id, position: decode_one_token(
                self.model, cache, token_id, position))
        return self._one_row_on(step, kernel, self.eager, "eager" if step is self.eager else "compiled")

    def _one_row_on(self, step: Any, kernel: bool, eager: Any, name: str) -> OneRowFeed:
        """The feed that runs `step` (whose eager form, owner included, is `eager`)."""
        owner = eager.owner

        @torch.inference_mode()
        def feed(cache: Any, token_id: int, position: int) -> torch.Tensor:
            if not all_slabs(cache):
                return decode_one_token(self.model, cache, token_id, position)
            layers = cache.layers
            buffers = [layer.step_buffers(position) for layer in layers]
            device = tree_leaves(buffers[0])[0].device  # a layer may hand pairs (FalconH1)
            logits = step(torch.tensor([token_id], device=device), torch.tensor([position], device=device),
                          attended_rows(position + 1, device), [k for k, _ in buffers], [v for _, v in buffers],
                          owner, kernel)
            for layer in layers:
                layer.wrote_row(position)
            return logits.float()

        return OneRowFeed(name, feed, kernel)
