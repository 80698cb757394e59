"""Where a decode-step package's build goes, phase by phase: `memrad bench build-phases` (memrad.bench.build_phases runs it).

    memrad bench build-phases [--model default] [--rows N] [--cache DIR] [--decode-steps 64]
                              [--wrapper-opt O0|O1] [--line-tables] [--isa-checks beside|in-codegen]

Builds the package as a start's child does (one torch thread, memrad.engine.decode.package.build)
on a compile cache of its own (a fresh temporary one unless `--cache` names one: a second
build on it shows what inductor's caches keep), timing each phase from the wall clock around
inductor's own functions: the export, the ISA checks inductor compiles to learn the CPU (run
beside the export, memrad.engine.decode.package), the precompiled headers, inductor's Python
(lowering, scheduling, codegen), each C++ compile (the wrapper, the kernels, the link) and the
package's write. Then, with `--decode-steps`, the built package against the eager step, ms a
token at 512 attended rows (`--wrapper-opt`: the wrapper's opt level, the A/B of
package._AOTI_OPTIONS). Numbers: docs/BENCHMARKS.md, Startup and compile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

PHASES = ("load the model", "export", "ISA checks (beside the export)", "ISA checks (in the codegen)",
          "precompiled headers", "inductor's Python",
          "C++: the wrapper", "C++: the kernels", "C++: the link", "write the package")


class _Clock:
    """Wall and CPU seconds per phase, from wrappers around the functions each phase runs (this
    harness only). CPU: the calling thread's, plus, for the compiler's phases, its children's
    (the g++ runs): on a shared machine the CPU seconds are what a quiet one would wait."""

    def __init__(self) -> None:
        self.wall_s: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            self.wall_s[phase] = self.wall_s.get(phase, 0.0) + wall_s
            self.cpu_s[phase] = self.cpu_s.get(phase, 0.0) + cpu_s

    def wrap(self, owner: object, name: str, phase) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            wall, cpu, children = time.perf_counter(), time.thread_time(), _children_cpu_s()
            try:
                return original(*args, **kwargs)
            finally:
                named = phase(args) if callable(phase) else phase
                if named:
                    spawned = _children_cpu_s() - children if named.startswith(("C++", "ISA", "precompiled")) else 0.0
                    self.add(named, time.perf_counter() - wall, time.thread_time() - cpu + spawned)

        setattr(owner, name, timed)


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cxx_phase(args: tuple) -> str:
    target = args[0].get_target_file_path()
    if target.endswith(".wrapper.o"):
        return "C++: the wrapper"
    if target.endswith(".kernel.o"):
        return "C++: the kernels"
    if target.endswith(".so") and ".wrapper" in target:
        return "C++: the link"
    return ""  # an ISA check's or a header's compile: timed as that phase


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench build-phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=0, help="the batched step's package of that many rows")
    parser.add_argument("--cache", type=Path, help="inductor's cache to build on (default: a fresh temporary one)")
    parser.add_argument("--decode-steps", type=int, default=0, help="then time the package against the eager step")
    parser.add_argument("--wrapper-opt", choices=("O0", "O1"), help="the wrapper's opt level instead of memra's")
    parser.add_argument("--line-tables", action="store_true", help="g++ -g1 as inductor's default (memra: none)")
    parser.add_argument("--isa-checks", choices=("beside", "in-codegen"), default="beside",
                        help="in-codegen: as inductor runs them alone (the A/B of package._check_isas_beside)")
    args = parser.parse_args(argv)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="memra-build-phases-"))
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before inductor reads it

    import torch
    import torch._inductor as inductor
    import torch._inductor.codecache as codecache
    from torch._inductor import cpp_builder, cpu_vec_isa

    from memrad.engine.decode import package, steps
    from memrad.engine.kernels import decode_attention
    from memrad.engine.kernels.build import cxx_compiler
    from memrad.engine.model.loader import load_model
    from memrad.engine.state.kv import MAX_RESERVED_TOKENS

    # The precompiled headers' directory is fixed when inductor's codecache is first imported
    # (often before this harness runs): point it into this cache too, so a fresh cache is fresh.
    codecache._HEADER_DIR = str(cache / "precompiled_headers")
    codecache._HEADER_LOCK_DIR = str(cache / "precompiled_headers" / "locks")
    if args.wrapper_opt:
        package._AOTI_OPTIONS["aot_inductor.compile_wrapper_opt_level"] = args.wrapper_opt
    if args.line_tables:
        package._AOTI_OPTIONS["aot_inductor.enable_line_tables"] = True
    if args.isa_checks == "in-codegen":
        def alone() -> threading.Thread:
            thread = threading.Thread(target=lambda: None)
            thread.start()
            return thread

        package._check_isas_beside = alone
    torch.set_num_threads(1)
    clock = _Clock()
    wall, cpu = time.perf_counter(), time.thread_time()
    loaded = load_model(args.model, device="cpu", allow_pull=False, progress=lambda _: None)
    clock.add("load the model", time.perf_counter() - wall, time.thread_time() - cpu)
    kernel = decode_attention.load(cxx_compiler()) is None
    capacity = min(loaded.context_len, MAX_RESERVED_TOKENS)
    step = steps.new_step(loaded.model, loaded.context_len)
    clock.wrap(torch.export, "export", "export")
    in_codegen = threading.Event()  # aot_compile runs: the ISA checks are inside it, not beside the export
    clock.wrap(cpu_vec_isa.VecISA, "check_build",
               lambda _: "ISA checks (in the codegen)" if in_codegen.is_set() else "ISA checks (beside the export)")
    clock.wrap(codecache, "_precompile_header", "precompiled headers")
    clock.wrap(cpp_builder.CppBuilder, "build", _cxx_phase)
    clock.wrap(inductor, "aot_compile", "aot_compile")
    timed_aot = inductor.aot_compile

    def aot_compile(*args, **kwargs):
        in_codegen.set()
        try:
            return timed_aot(*args, **kwargs)
        finally:
            in_codegen.clear()

    inductor.aot_compile = aot_compile
    clock.wrap(package, "_write", "write the package")
    out = Path(tempfile.mkdtemp(prefix="memra-build-phases-out-"))
    path = package.package_path(step, loaded.model.config, capacity, kernel, out, args.rows or None)
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu_s()
    package.build(step, loaded.model.config, capacity, kernel, path, args.rows or None)
    total_wall_s, total_cpu_s = time.perf_counter() - wall, time.process_time() - cpu + _children_cpu_s() - children
    # inductor's Python: aot_compile less what ran inside it in g++ (the calling thread's CPU is its own).
    inside = ("C++", "precompiled headers", "ISA checks (in the codegen)")
    clock.wall_s["inductor's Python"] = clock.wall_s.pop("aot_compile", 0.0) - sum(
        v for k, v in clock.wall_s.items() if k.startswith(inside))
    clock.cpu_s["inductor's Python"] = clock.cpu_s.pop("aot_compile", 0.0)
    print(f"model={loaded.model_id} dtype={loaded.dtype_name} weights={loaded.weights_name} kernel={kernel} "
          f"rows={args.rows or 1} wrapper={package._AOTI_OPTIONS.get('aot_inductor.compile_wrapper_opt_level', 'O1')} "
          f"isa-checks={args.isa_checks} line-tables={package._AOTI_OPTIONS['aot_inductor.enable_line_tables']} "
          f"cache={cache}")
    print(f"  {'phase':34s} {'wall s':>7s} {'CPU s':>7s}")
    for phase in PHASES:
        if phase in clock.wall_s:
            print(f"  {phase:34s} {clock.wall_s[phase]:7.1f} {clock.cpu_s[phase]:7.1f}")
    print(f"  {'the build (package.build)':34s} {total_wall_s:7.1f} {total_cpu_s:7.1f}")
    if args.decode_steps:
        eager_ms, packaged_ms = _decode_ms(step, loaded.model.config, capacity, kernel, path, args.decode_steps)
        print(f"decode at 512 rows, 1 thread: eager {eager_ms:.2f} ms, package {packaged_ms:.2f} ms a token "
              f"(package / eager {packaged_ms / eager_ms:.3f})")
    return 0


def _decode_ms(step, config, capacity: int, kernel: bool, path: Path, num_steps: int) -> tuple[float, float]:
    """Median ms a token of the eager step and of the package at `path`, interleaved, 512 rows attended."""
    import torch

    from memrad.engine.decode import package
    from memrad.engine.decode.steps.llama import attended_rows
    from memrad.engine.state.kv import reserve

    packaged = package.load(step, capacity, kernel, path)
    keys, values, _ = package.example_buffers(step, config, capacity, 512, reserve)
    rows, token, position = attended_rows(512, torch.device("cpu")), torch.tensor([7]), torch.tensor([511])
    times: dict[str, list[float]] = {"eager": [], "package": []}
    with torch.inference_mode():
        for _ in range(num_steps):
            for name, fn in (("eager", step), ("package", packaged)):
                started = time.perf_counter()
                fn(token, position, rows, keys, values, step.owner, kernel)
                times[name].append((time.perf_counter() - started) * 1e3)
    return statistics.median(times["eager"][2:]), statistics.median(times["package"][2:])
