"""How memra's C++ kernels are built: one compiler, one set of flags, one cache of libraries.

Every kernel of csrc/ (decode attention, prefill attention, block GEMV) is built the same way,
once per machine and torch, and loaded by its own module (memrad.engine.kernels.decode_attention,
.prefill_attention, .block_gemv):

    csrc/<kernel>.cpp --g++ (flags of torch's CPU capability)--> <cache>/kernels/
        <kernel>-<capability>-<hash of source, flags, torch>.so  --torch.ops.load_library-->  op

A kernel is compiled with the vector width torch itself dispatches to on this CPU (AVX512, AVX2
or plain), never `-march=native`, so `ATEN_CPU_CAPABILITY=avx2` emulates an AVX2 machine
honestly (`MEMRA_KERNEL_ISA=avx2` builds memra's kernels alone that way, under their own
library name, while torch keeps its own capability) (`-march=native`, `-mtune=native` or AVX512-BF16 conversions were measured to change
nothing here), and with OpenMP, which `at::parallel_for` is written in (without it the tasks
ran on one thread; both: docs/BENCHMARKS.md, Decode: the attention kernel). A build takes
seconds; later loads take milliseconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from memrad.durable import publish

log = logging.getLogger("memrad.engine")

CSRC = Path(__file__).parent / "csrc"  # the kernels' sources

# torch's CPU capability -> the defines its vector headers read and the ISA they need
# (the flags inductor compiles its own CPU code with).
_CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq",
               "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}

BUILD_TIMEOUT_S = 600  # a build takes seconds; a compiler that hangs must not hold the start forever


class BuildFailed(RuntimeError):
    """g++ could not build a kernel; the message carries the compiler's first error."""


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU (and the kernels are built with), or None."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return next((path for path in map(shutil.which, ("g++", "c++", "clang++")) if path), None)


ISA_ENV = "MEMRA_KERNEL_ISA"  # avx2 | avx512 | default: build the kernels for this ISA (at most torch's)
_ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")


def capability() -> str:
    """The ISA the kernels are built for: torch's CPU capability, or a lower one named by
    MEMRA_KERNEL_ISA (the AVX2 path tested and timed on an AVX-512 machine, as on an AVX2-only
    CPU). A name above torch's capability, or unknown, is ignored: it would not run here."""
    torch_isa = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get(ISA_ENV, "").upper()
    if forced in _ISA_ORDER and torch_isa in _ISA_ORDER and _ISA_ORDER.index(forced) <= _ISA_ORDER.index(torch_isa):
        return forced
    return torch_isa


def compile_command(compiler: str, output: Path, source: Path) -> list[str]:
    from torch.utils import cpp_extension

    flags = _CAPABILITY_FLAGS.get(capability(), ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"])
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [arg for path in cpp_extension.library_paths() for arg in (f"-L{path}", f"-Wl,-rpath,{path}")]
    # -fopenmp: at::parallel_for is inline OpenMP; without it the tasks run on one thread.
    # libgomp resolves to the one torch ships and has loaded (its soname, torch's lib dir).
    return [compiler, "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *flags, *includes, str(source), "-o", str(output), *libraries, "-lc10", "-ltorch_cpu"]


def library_path(compiler: str, source: Path) -> Path:
    """Where this machine's build lives: named by what went into it, so a new torch, CPU
    capability or source builds afresh and never loads a stale library."""
    from memrad.paths import cache_dir

    recipe = "\0".join([source.read_text(), torch.__version__, sys.version,
                         *compile_command(compiler, Path("out"), source)])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{capability().lower()}-{digest}.so"


def build(compiler: str, source: Path) -> Path:
    """The library for this machine, compiled now unless the cache has it. Safe against a
    concurrent build by another process (each writes its own file, renamed into place).
    `source`: one of csrc/."""
    path = library_path(compiler, source)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for abandoned in path.parent.glob("*.partial"):  # builds a stopped daemon never finished
        if time.time() - abandoned.stat().st_mtime > 3600:
            abandoned.unlink(missing_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    try:
        result = subprocess.run(compile_command(compiler, partial, source), capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise BuildFailed(f"{compiler} did not build {source.name} within {BUILD_TIMEOUT_S} s") from None
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
        raise BuildFailed(f"{compiler} could not build {source.name}: {(errors or ['no output'])[0][:300]}")
    publish(partial, path)
    log.info("built the CPU kernel %s: %s", source.stem, path)
    return path


def unavailable(compiler: str | None, source: Path, name: str, build_missing: bool = True) -> str | None:
    """Why `source`'s library cannot be loaded without trying (no compiler; not built yet, when
    `build_missing=False` only loads an earlier build), else None. `name`: the kernel as the
    reason calls it."""
    if compiler is None:
        return f"no C++ compiler to build {name} (install g++)"
    if not build_missing and not library_path(compiler, source).exists():
        return f"{name} is not built yet"
    return None


def load_library(compiler: str, source: Path) -> str | None:
    """Load `source`'s library into this process, built now unless the cache has it; None once
    loaded, else what went wrong. Never raises."""
    try:
        torch.ops.load_library(str(build(compiler, source)))
    except (BuildFailed, OSError, RuntimeError) as exc:
        return str(exc)
    return None


def checked_load(compiler: str, source: Path, check: Callable[[], str | None]) -> str | None:
    """`load_library`, then `check()` (the kernel's probe: None or "" when it computes what it
    should); None when both passed, else the first line of what went wrong. Never raises."""
    why_not = load_library(compiler, source)
    if why_not is None:
        try:
            why_not = check() or None
        except (OSError, RuntimeError) as exc:
            why_not = str(exc)
    return why_not.splitlines()[0][:300] if why_not else None


class ProbedKernel:
    """One kernel of csrc/ made callable once per process: built (unless the cache must
    already have it), loaded and checked by its `probe` ("" or None when it computes what it
    should). `why_not()` is None once it runs, else why not; never raises."""

    def __init__(self, source: Path, name: str, probe: Callable[[], str | None]) -> None:
        self.source, self.name, self.probe = source, name, probe
        self._lock = threading.Lock()
        self._why_not: str | None = None
        self._checked = False

    def why_not(self, build_missing: bool = True) -> str | None:
        """`build_missing=False` only loads a library an earlier build left in the cache."""
        with self._lock:
            if self._checked:
                return self._why_not
            compiler = cxx_compiler()
            untried = unavailable(compiler, self.source, self.name, build_missing)
            if untried is not None:
                return untried
            self._why_not = checked_load(compiler, self.source, self.probe)
            self._checked = True
            return self._why_not
