"""Building the decode step's packages away from serving: in a child process, on a background thread.

    Decoder (compile = auto) --start_thread--> memrad-compile thread
        --build_package--> build_in_child(recipe)  --`python -m memrad.engine.decode.builder`-->  child:
            die_with(daemon), load the model as the daemon did, package.build(...) -> the .pt2 at `path`
        (no recipe: package.build in this process)
        where AOTInductor fails: torch_compiled(step), traced here (inductor's caches: compile_cache_dir)

Export and inductor are Python-heavy: on the daemon's own interpreter they held the GIL against
the engine thread (measured: docs/BENCHMARKS.md, Decode: the step's parts), so a daemon builds
in a child that loads the model itself and runs one torch thread. The child dies with the
daemon however the daemon dies, and `memrad stop` stops it (`stop_children`); what it leaves
half-written is pruned (memrad.engine.decode.package.prune).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memrad.engine.decode import build_times, package, steps
from memrad.engine.decode.steps import llama as decode_step
from memrad.engine.decode.steps.llama import attended_rows
from memrad.engine.kernels import decode_attention
from memrad.engine.kernels.build import cxx_compiler
from memrad.engine.state.kv import MAX_RESERVED_TOKENS, reserve

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_BATCH_BUILD_NICENESS = 10


def start_thread(target: Callable[[], None]) -> threading.Thread:
    """Run a build (`target`) on the background thread compile = auto builds on; the daemon
    serves meanwhile and does not wait for it at exit."""
    thread = threading.Thread(target=target, name="memrad-compile", daemon=True)
    thread.start()
    return thread


def build_package(recipe: "Recipe | None", step: Any, config: Any, capacity: int, kernel: bool, path: Path,
                  rows: int | None = None, phase: Callable[[str], None] = lambda _: None) -> Path:
    """The package at `path` built: in a child process when there is a `recipe` (a daemon),
    else in this one (a test, a bench). `phase` hears each phase as the build reaches it
    (memrad.engine.decode.build_times.PHASES). Returns `path`."""
    if recipe is not None:
        build_in_child(recipe, kernel, path, rows=rows, phase=phase)
    else:
        package.build(step, config, capacity, kernel, path, rows, phase)
    return path


def compile_cache_dir() -> str:
    """Where compiled decode steps are kept between starts: memra's cache (compile/), unless
    TORCHINDUCTOR_CACHE_DIR names another directory (a benchmark's or a test's fresh cache).

    Inductor writes its own default (/tmp/torchinductor_<user>) into that variable the first
    time anything asks for its cache, and loading a model does: that default is not a
    choice, and /tmp does not outlive a reboot. The variable is then pointed here, so
    inductor's own caches (the torch.compile fallback) live here too."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from memrad.paths import cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    path = cache_dir() / "compile"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return str(path)


def torch_compiled(eager: Any, config: Any, capacity: int, kernel: bool) -> Any:
    """`eager` under torch.compile (the fallback where AOTInductor fails), every graph it has
    traced now on scratch slabs, so no request pays for a trace."""
    options = {**package.options_for(eager), "guard_filter_fn": _guards_to_keep}
    compiled = torch.compile(eager, fullgraph=True, options=options)
    param = next(eager.parameters())
    # One trace per graph: the attended length is marked dynamic, every other size static.
    split = decode_step.SPLIT_ROWS
    lengths = [3] + ([split + 1] if split + 2 <= capacity and not kernel else [])
    with torch.inference_mode():  # as in the decoder's feed: the guards check the tensors' kind
        token = torch.zeros(1, dtype=torch.long, device=param.device)
        for length in lengths:
            position = torch.tensor([length - 1], device=param.device)
            rows = attended_rows(length, param.device)
            torch._dynamo.mark_dynamic(rows, 0)
            # Contents never read back; CPU reservations are zero pages.
            keys, values, windowed = package.example_buffers(eager, config, capacity, length, reserve)
            for buffer in windowed:
                torch._dynamo.mark_dynamic(buffer, 2)
            compiled(token, position, rows, keys, values, eager.owner, kernel)
    return compiled


def _guards_to_keep(entries: list) -> list[bool]:
    """Every guard but those on the step's modules and weights, which cannot change after the
    load: checking them cost far more per token than all the rest (measured: docs/BENCHMARKS.md,
    Decode: the step's parts). The step's `owner` argument keeps its guard, so another step's
    graph never runs."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() for entry in entries]


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to load the model a step was made from, so another process can build its package:
    the loader's arguments for the model as the daemon loaded it."""

    folder: str
    dtype: str  # "bfloat16", "float32", ...
    weights: str  # "int4", "float", ...
    context_len: int
    # torch threads at the daemon's load (LoadedModel.threads): the child loads at it, so it reads
    # the kernel verdicts the daemon measured (kept per thread count) and makes the daemon's step.
    threads: int = 1
    # The cache rows' dtype as the daemon's load chose it (memrad.engine.model.kv_dtype): the child's
    # step is handed those rows.
    kv_dtype: str = "activations"

    @classmethod
    def of(cls, loaded: Any) -> "Recipe":
        """The recipe for a memrad.engine.model.loader.LoadedModel as it was loaded."""
        return cls(str(loaded.folder), loaded.dtype_name, loaded.weights_name, loaded.context_len, loaded.threads,
                   "bfloat16" if loaded.kv.value == "bfloat16" else "activations")


_children: set[subprocess.Popen] = set()  # builds running now (`stop_children`)


class BuildKilled(RuntimeError):
    """The build's child died of a signal (`memrad stop`, the OOM killer, a user's kill):
    not a sign that AOTInductor cannot compile the step, so no fallback is tried."""


PHASE_LINE = "memra-phase: "  # how the child says which phase it reached, one line on its stdout each


def build_in_child(recipe: Recipe, kernel: bool, path: Path, timeout_s: float = 1800, rows: int | None = None,
                   phase: Callable[[str], None] = lambda _: None) -> None:
    """`package.build` in a child process that loads the model itself. Export and inductor are
    Python-heavy: on the daemon's own interpreter they held the GIL against the engine thread,
    and a reply served meanwhile decoded at a small fraction of its speed (measured:
    docs/BENCHMARKS.md, Decode: the step's parts). The child runs one torch thread, leaving the
    other core to serving. `rows`: the batched step's package. `phase` hears each phase the
    child reaches (its PHASE_LINE lines). Raises RuntimeError with the child's last lines if
    it fails."""
    args = [sys.executable, "-m", "memrad.engine.decode.builder", recipe.folder, recipe.dtype, recipe.weights,
            str(recipe.context_len), "kernel" if kernel else "torch", str(path), str(rows or 0), str(os.getpid()),
            str(recipe.threads), recipe.kv_dtype]
    run_child(args, timeout_s, phase)


def run_child(args: list[str], timeout_s: float, phase: Callable[[str], None]) -> None:
    """Run a build's child (`args`) to its end, relaying each PHASE_LINE it prints to `phase`
    as it comes; raises BuildKilled if a signal ended it, RuntimeError (with its stderr's
    last line) if it failed or ran past `timeout_s`."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: the child never blocks on it
        child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, stdin=subprocess.DEVNULL)
        _children.add(child)
        timed_out = threading.Event()
        timer = threading.Timer(timeout_s, lambda: timed_out.set() or child.kill())
        timer.start()
        try:
            for line in child.stdout:  # until the child ends (or is killed): its phases as they come
                if line.startswith(PHASE_LINE):
                    phase(line.removeprefix(PHASE_LINE).strip())
            child.wait()
        finally:
            timer.cancel()
            child.stdout.close()
            _children.discard(child)
        if timed_out.is_set():
            raise RuntimeError(f"building the package took more than {timeout_s:.0f} s")
        if child.returncode < 0:
            raise BuildKilled(f"the package build was killed (signal {-child.returncode})")
        if child.returncode != 0:
            err.seek(0)
            last = [line for line in err.read().splitlines() if line.strip()][-1:] or [f"exit {child.returncode}"]
            raise RuntimeError(f"the package build exited with {child.returncode}: {last[0][:300]}")


def stop_children() -> None:
    """Stop builds still running (at `memrad stop`): a stopped daemon leaves no work behind."""
    for child in list(_children):
        child.kill()


def die_with(parent: int) -> None:
    """End this process when `parent` dies, however it dies (a `kill -9` of the daemon
    included): a build nobody waits for would hold a core and gigabytes for minutes. Linux
    sends the signal when the thread that started this process ends; `build_in_child` waits
    on it from that thread, so that is the daemon's death. Elsewhere, a thread polls."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError):  # no prctl (macOS): watch the parent
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="memrad-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def main(argv: list[str]) -> int:
    """The child of `build_in_child`: load the model as the daemon did, build the package."""
    from memrad.engine.model.loader import load_model

    folder, dtype, weights, context_len, attention, path, batch, parent, threads, kv_dtype = argv
    die_with(int(parent))
    kernel, rows = attention == "kernel", int(batch) or None
    if rows:  # the batched steps build while the daemon serves on the one-row step: serving first
        os.nice(_BATCH_BUILD_NICENESS)
    torch.set_num_threads(int(threads))  # the load's: the daemon's kernel verdicts, kept per thread count

    def say(phase: str) -> None:
        print(f"{PHASE_LINE}{phase}", flush=True)

    say(build_times.PHASES[0])
    loaded = load_model(folder, device="cpu", dtype=dtype, weights=weights, allow_pull=False,
                        progress=lambda _: None, context=int(context_len), kv_dtype=kv_dtype)
    torch.set_num_threads(1)  # then one thread for the build, the other core left to serving
    if kernel and decode_attention.load(cxx_compiler()) is not None:
        print("memra's attention kernel is not available to the child", file=sys.stderr)
        return 2
    capacity = min(int(context_len), MAX_RESERVED_TOKENS)
    step = steps.new_step(loaded.model, int(context_len))
    mine = package.package_path(step, loaded.model.config, capacity, kernel, Path(path).parent, rows)
    if mine != Path(path):  # another load would make another step: never build it under this name
        print(f"the child's step is {mine.name}, not {Path(path).name}", file=sys.stderr)
        return 3
    package.build(step, loaded.model.config, capacity, kernel, Path(path), rows, say)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
