"""The decode step compiled ahead of time (AOTInductor): built once, loaded by later starts.

torch.compile traces the step again in every process (dynamo re-traces the default model's two
30-layer graphs, seconds of every start) even when inductor's caches hold the compiled code. An
AOTInductor package is the compiled code itself: `torch.export` captures each graph once,
inductor compiles it into a shared library, and a later start only opens the library
(milliseconds; measured: docs/BENCHMARKS.md, Startup and compile; why: docs/ARCHITECTURE.md,
"The decode step").

    compile/decode-step-{model}-{weights}-{dtype}-attn-{memra|torch}-torch{version}-{cpu}-{key}.pt2
        with memra's attention kernel (memrad.engine.kernels.decode_attention):
            graph "kernel" attended length in [2, capacity - 2]
                           (Gemma 3: and the sliding layers' window rows in [2, W], a second size)
        with torch's attention:
            graph "short"  attended length in [2, SPLIT_ROWS - 1]
            graph "split"  attended length in [SPLIT_ROWS, capacity - 2]   (if the slabs reach it)
    ...{key}.constants.safetensors
        the constants inductor made itself (the int4 op's group size, as a tensor per call)
    decode-step-...-rows{B}-...-{key}.pt2  (a step with a batched twin, memra's kernel)
            graph "batch"  B rows (memrad.engine.decode.batch), each row's attended length its
                           own symbol in [2, capacity - 1] (Gemma, gpt-oss: and each row's window view
                           rows its own in [2, W], shared by that row's sliding layers)

memra's kernel is a C++ op (`memra::decode_attention`, TORCH_LIBRARY): the library calls it
by name through AOTInductor's proxy executor, so the kernel must be loaded into the process
before a package that uses it is opened (the loader looks its schema up then). So must
memra's block kernel (`memra::block_gemv`, memrad.engine.model.block_linear) where the step's
layers run GGUF blocks on it: the model's load has loaded it by then.

The weights are not in the package: a start hands the library the step's own tensors by
reference (`user_managed`), so nothing is copied and resident memory does not grow. So the
key names everything the compiled code was made for besides their values: the step's code,
torch and transformers, the CPU, the model's config, each weight's name, dtype, shape and
strides, the slab capacity (and the window buffers' rows), SPLIT_ROWS and the attention
(with the kernel's source). Any change is another file, never a wrong graph; the directory
keeps the 8 most recently used (`prune`).

The attended length stays symbolic within each graph's range, every other size is static.
Lengths outside the ranges (a one-token prompt's first step, the slab's last row, a slab that
grew) run the eager step: the choice depends on the position only, so a resumed turn still
decodes each position exactly as its cold run does.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memrad.engine.decode import batch as batch_step
from memrad.engine.decode import build_times
from memrad.engine.decode import steps
from memrad.engine.decode.batch import BatchGraph
from memrad.engine.decode.steps import llama as decode_step
from memrad.engine.decode.steps.llama import DecodeStep, attended_rows
from memrad.engine.kernels import block_gemv, decode_attention
from memrad.engine.model import block_linear, quant
from memrad.engine.state import recurrent as recurrent_state
from memrad.engine.state import window as window_state
from memrad.engine.state.shared import SharedLayer
from memrad.engine.state.window import buffer_rows
from memrad.durable import publish
from memrad.faultpoint import kill_point
from memrad.process import pid_alive

# How inductor compiles the llama-shaped steps, one-row and batched (the packages and
# torch.compile's fallback): it rounds to the activation dtype wherever eager would between
# ops it fuses. Without it inductor keeps fused intermediates in float32 and decides per
# graph which to recompute, so the one-row step and the batched step gave one request
# different logits (0.44 apart, every step); with it the one-row step and the 2- and 4-row
# batched steps give it the same bits, beside any neighbours, at no measured cost
# (docs/BENCHMARKS.md, "One request, the same bits on every step"). That is what lets a
# request move between them by how many are in flight.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
# What AOTInductor is asked for besides: the weights stay out of the library (supplied at
# load), and the constants it makes itself come back to the caller so they can be kept beside it.
# No line tables (g++ -g1, for profilers): debug info never changes the code g++ emits, and
# -g1 doubled the compile of the wrapper (one 14k-line C++ file, the longest phase after
# inductor's Python: docs/BENCHMARKS.md, Startup and compile). The wrapper stays at -O1:
# -O0 halved its compile too but decoded ~4% slower.
_AOTI_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
    "aot_inductor.enable_line_tables": False,
}
_LAYOUT = "1"  # of the files this module writes; bump when it changes
# In the compile cache: several models and configurations side by side. A configuration's packages
# are its one-row step and 2, 4 and 8 rows (speculation's runs); 8 kept two, so a third one's builds
# pruned a package another had just built and not yet opened (its constants gone: seen in one test
# run with the default model in two dtypes and gemma3). 2-6 MB each.
KEEP_PACKAGES = 24


def graph_ranges(capacity: int, kernel: bool) -> dict[str, tuple[int, int]]:
    """{graph: (shortest, longest attended length)} for slabs of `capacity` rows.

    The split attention reads one row past an odd length, so the longest is capacity - 2
    (at capacity - 1 the two halves would cover the whole slab: another graph). The first
    decode step attends at least 2 rows (a prompt of 1 and the new token)."""
    last, split = capacity - 2, decode_step.SPLIT_ROWS
    if kernel:
        return {"kernel": (2, last)} if 2 < last else {}
    ranges = {"short": (2, min(split - 1, last)), "split": (split, last)}
    return {graph: (low, high) for graph, (low, high) in ranges.items() if low < high}


BATCH_GRAPH = "batch"


def batch_range(capacity: int) -> tuple[int, int]:
    """(shortest, longest attended length) of a row in the batch graph: a first step attends
    at least 2 rows (a prompt of 1 and the new token), and a slab's last row makes it grow."""
    return 2, capacity - 1


def package_path(step: DecodeStep, config: Any, capacity: int, kernel: bool, directory: Path,
                 rows: int | None = None) -> Path:
    """Where the package for this step, model config, slab capacity and attention (`kernel`:
    memra's) lives in `directory`; `rows`: the batched step of that many rows."""
    weights = "int4" if any(isinstance(m, (quant.Int4Linear, block_linear.BlockLinear)) for m in step.modules()) else "float"
    dtype = str(_param(step).dtype).removeprefix("torch.")
    label = Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model"
    attention = "memra" if kernel else "torch"
    batch = f"-rows{rows}" if rows else ""
    rows_dtype = str(rows_dtype_of(step)).removeprefix("torch.")
    dtype += f"-kv-{rows_dtype}" if rows_dtype != dtype else ""
    return directory / (f"decode-step-{_safe(label)}{batch}-{weights}-{dtype}-attn-{attention}-"
                        f"torch{_safe(torch.__version__)}-{torch.backends.cpu.get_cpu_capability().lower()}-"
                        f"{_key(step, config, capacity, kernel, rows)}.pt2")


def constants_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".pt2") + ".constants.safetensors")


class PackagedStep:
    """Called like a DecodeStep; runs the package's graph for the attended length."""

    def __init__(self, eager: DecodeStep, runners: dict[str, Any], made: dict[str, torch.Tensor],
                 capacity: int, kernel: bool) -> None:
        self.eager, self.runners, self.capacity, self.kernel = eager, runners, capacity, kernel
        self._made = made  # the library holds pointers into these (user_managed): keep them alive
        self._ranges = [(low, high, runners[graph]) for graph, (low, high) in graph_ranges(capacity, kernel).items()]
        # A full-attention layer's slab: its rows are the capacity the graphs were made for;
        # a sliding layer's buffer: its rows are fixed (buffer_rows), checked all the same.
        windows = steps.windows(eager)
        self._slab = next(iter(steps.slabs(eager)), None)
        self._window = next(((i, buffer_rows(w)) for i, w in enumerate(windows) if w is not None), None)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor], owner: str, kernel: bool) -> torch.Tensor:
        assert owner == self.eager.owner and kernel == self.kernel, (owner, kernel)
        length = rows.shape[0]
        runner = next((r for low, high, r in self._ranges if low <= length <= high), None)
        grown = self._slab is not None and keys[self._slab].shape[2] != self.capacity
        if self._window is not None:
            at, buffer = self._window
            grown = grown or keys[at].stride(1) != buffer * keys[at].shape[3]
        if runner is None or grown:  # outside the ranges, a grown slab
            return self.eager(token, position, rows, keys, values, owner, kernel)
        # The graph's inputs are the leaves in order (a layer may hand a pair of tensors: FalconH1).
        return runner.boxed_run(tree_leaves([token, position, rows, keys, values]))[0]  # logits [V]


class PackagedBatch:
    """Called like a BatchGraph (memrad.engine.decode.batch); runs the package's batch graph."""

    def __init__(self, runner: Any, made: dict[str, torch.Tensor], capacity: int, rows: int,
                 slabs: list[int], windows: list[tuple[int, int]]) -> None:
        self.runner, self.capacity, self.rows = runner, capacity, rows
        self._made = made  # the library holds pointers into these (user_managed): keep them alive
        self._slabs = slabs  # the layers handing slabs (LFM2's conv layers hand their conv state)
        self._windows = windows  # (layer, its buffer's rows) of each sliding layer (Gemma's window views)

    def fits(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> bool:
        """The graph runs a row attending `length` rows of these slabs [(keys, values) per layer]:
        the length is in its range and the slabs have the rows it was made for (a window view:
        the strides of its buffer's rows, as PackagedStep checks them)."""
        low, high = batch_range(self.capacity)
        return (low <= length <= high and all(buffers[i][0].shape[2] == self.capacity for i in self._slabs)
                and all(buffers[i][0].stride(1) == rows * buffers[i][0].shape[3] for i, rows in self._windows))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[torch.Tensor],
                 keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]]) -> torch.Tensor:
        assert tokens.shape[0] == self.rows, (tokens.shape, self.rows)
        return self.runner.boxed_run(tree_leaves([tokens, positions, rows, keys, values]))[0]  # logits [B, V]


def load(step: DecodeStep, capacity: int, kernel: bool, path: Path) -> PackagedStep:
    """Open the package at `path` for `step`, handing it the step's own tensors (no copy).
    With `kernel`, memra's attention kernel must be loaded already (decode_attention.load).

    Uses torch's C++ loader directly: `torch._inductor.aoti_load_package` does the same
    after importing inductor's Python side, which a start does not need (its cost:
    docs/BENCHMARKS.md, Startup and compile)."""
    made, runners = _open(step, path, graph_ranges(capacity, kernel))
    return PackagedStep(step, runners, made, capacity, kernel)


def load_batch(step: DecodeStep, capacity: int, rows: int, path: Path) -> PackagedBatch:
    """Open the batched step's package (built by `build(..., rows=rows)`), as `load` does."""
    made, runners = _open(step, path, [BATCH_GRAPH])
    windows = [(i, buffer_rows(window)) for i, window in enumerate(steps.windows(step)) if window is not None]
    return PackagedBatch(runners[BATCH_GRAPH], made, capacity, rows, steps.slabs(step), windows)


def _open(step: DecodeStep, path: Path, graphs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    made = load_file(str(constants_path(path)))  # {"graph/name": tensor}
    os.utime(path)  # used now: `prune` keeps the most recently used
    state = _constants(step)
    runners = {}
    for graph in graphs:
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), graph, False, 1, -1)
        fqns = runner.get_constant_fqns()
        supplied = {fqn: state[fqn] if fqn in state else made[f"{graph}/{fqn}"] for fqn in fqns}
        # (use_inactive, check_full_update, user_managed, allow_h2d_copy)
        runner.load_constants(supplied, False, True, True, False)
        runners[graph] = runner
    return made, runners


def options_for(step: Any) -> dict[str, Any]:
    """Inductor's options for `step`: INDUCTOR_OPTIONS for a step with a batched twin (the
    llama-shaped step, LFM2's, Gemma's, gpt-oss's), none for the others (the hybrids decode one
    row at a time)."""
    return dict(INDUCTOR_OPTIONS) if steps.has_batched(step) else {}


def build(step: DecodeStep, config: Any, capacity: int, kernel: bool, path: Path, rows: int | None = None,
          phase: Callable[[str], None] = lambda _: None) -> None:
    """Export the step's graphs (`rows`: the batched step's one graph of that many rows),
    compile them with AOTInductor and write the package and its constants at `path`
    (atomically: a package is only ever there complete). `phase` hears each phase as it
    starts (build_times.PHASES). A minute or more (docs/BENCHMARKS.md, Startup and compile)."""
    from torch._inductor import aot_compile

    _, exporting, compiling, writing = build_times.PHASES
    files, weights = {}, {}
    phase(exporting)
    checks = _check_isas_beside()
    programs = list(_batch_programs(step, config, capacity, kernel, rows) if rows else _step_programs(
        step, config, capacity, kernel))
    checks.join()
    phase(compiling)
    options = {**_AOTI_OPTIONS, **options_for(step)}
    for graph, program in programs:
        compiled = aot_compile(program.module(check_guards=False), *program.example_inputs, options=options)
        files[graph] = [item for item in compiled if isinstance(item, str)]
        weights[graph] = {name: tensor for item in compiled if not isinstance(item, str)
                          for name, (tensor, _) in item.items()}
    phase(writing)
    _write(step, path, files, weights)


def _check_isas_beside() -> threading.Thread:
    """Inductor's ISA checks started on a thread, so they run beside the export.

    To learn what the CPU runs, inductor compiles and loads a small library per vector ISA the
    CPU claims (up to 10 g++ runs on a fresh cache; a quarter of a first build's time here:
    docs/BENCHMARKS.md, Startup and compile), one after another, on the first codegen. They
    are g++ processes, so they do not hold the GIL: on a second core they cost the export
    nothing. Their answers are kept where inductor keeps them (its cache directory and its
    own memo), and inductor then reads the same answers it would have computed itself."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    def check() -> None:
        try:
            valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - inductor asks again on its own codegen and says why there
            pass

    thread = threading.Thread(target=check, name="memrad-isa-checks", daemon=True)
    thread.start()
    return thread


def _batch_programs(step: DecodeStep, config: Any, capacity: int, kernel: bool, rows: int):
    """The batched step exported: row r's `length_rows` first size is its own symbol, and so
    are the rows of its window views (every sliding layer of row r has the same)."""
    assert kernel and steps.has_batched(step), "the batched package: a step with a batched twin, memra's kernel"
    device = _param(step).device
    windows = steps.windows(step)
    window = next((w for w in windows if w is not None), None)
    # Distinct examples: export never takes two rows' sizes (or a view's and a length) for one.
    # Window views' rows 2 .. rows + 1, the lengths above them.
    assert window is None or rows + 1 <= window, f"{rows} rows' window views of distinct sizes do not fit W = {window}"
    views = [2 + r if window is not None else None for r in range(rows)]
    lengths = [(rows + 2 if window is not None else 3) + r for r in range(rows)]
    slabs = [example_buffers(step, config, capacity, length, _untouched, view)[:2] for length, view in zip(lengths, views)]
    args = (torch.zeros(rows, dtype=torch.long, device=device), torch.tensor([n - 1 for n in lengths], device=device),
            [attended_rows(n, device) for n in lengths], [k for k, _ in slabs], [v for _, v in slabs])
    low, high = batch_range(capacity)
    per_row = [{0: torch.export.Dim(f"length_{r}", min=low, max=high)} for r in range(rows)]
    view_rows = [torch.export.Dim(f"window_{r}", min=2, max=window) if window is not None else None for r in range(rows)]
    per_layer = [[{2: view_rows[r]} if w is not None else None for w in windows] for r in range(rows)]
    dims = ({}, {}, per_row, per_layer, per_layer)
    with torch.no_grad():
        program = torch.export.export(BatchGraph(_twin(step), kernel), args, dynamic_shapes=dims, strict=False)
    yield BATCH_GRAPH, program


def _step_programs(step: DecodeStep, config: Any, capacity: int, kernel: bool):
    exported = _Exported(_twin(step), kernel)
    for graph, (low, high) in graph_ranges(capacity, kernel).items():
        length = low + 1
        device = _param(step).device
        # Export reads only their shapes: untouched memory, never written.
        keys, values, windowed = example_buffers(step, config, capacity, length, _untouched)
        args = (torch.zeros(1, dtype=torch.long, device=device), torch.tensor([length - 1], device=device),
                attended_rows(length, device), keys, values)
        window = [w for w in steps.windows(step) if w is not None]
        # The window views' rows: their own symbol (min(position + 1, W)), shared by every sliding layer.
        rows_of_window = torch.export.Dim(f"window_{graph}", min=2, max=window[0]) if window else None
        per_layer = [{2: rows_of_window} if w is not None else None for w in steps.windows(step)]
        # A layer handed a pair of tensors (FalconH1) has static sizes: one None per tensor.
        key_dims, value_dims = ([(None,) * len(b) if isinstance(b, tuple) else dim for b, dim in zip(buffers, per_layer)]
                                for buffers in (keys, values))
        dims = ({}, {}, {0: torch.export.Dim(f"length_{graph}", min=low, max=high)}, key_dims, value_dims)
        with torch.no_grad():
            program = torch.export.export(exported, args, dynamic_shapes=dims, strict=False)
        yield graph, program


def _write(step: DecodeStep, path: Path, files: dict[str, list[str]], weights: dict[str, dict]) -> None:
    from safetensors.torch import save_file
    from torch._inductor.package import package_aoti

    # Each builder stages its own files (two starts may build at once); package_aoti wants .pt2.
    staging = path.with_name(path.name.removesuffix(".pt2") + f".{os.getpid()}.partial.pt2")
    staged_constants = constants_path(path).with_suffix(f".{os.getpid()}.partial")
    try:
        package_aoti(str(staging), files)
        kill_point("package-staged")
        # Keep what the step does not hold: the constants inductor made (named as it named them).
        state = _constants(step)
        made = {f"{graph}/{fqn}": weights[graph][fqn].detach().clone().contiguous()
                for graph in files for fqn in torch._C._aoti.AOTIModelPackageLoader(str(staging), graph, False, 1, -1)
                .get_constant_fqns() if fqn not in state}
        # The package last: its presence says both files are complete.
        save_file(made, str(staged_constants))
        publish(staged_constants, constants_path(path))
        kill_point("package-rename")
        publish(staging, path)
    finally:  # a failed build leaves nothing behind
        staging.unlink(missing_ok=True)
        staged_constants.unlink(missing_ok=True)
    prune(path.parent)


def example_buffers(step: Any, config: Any, capacity: int, length: int, make: Any, view_rows: int | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values as the step is handed them at attended `length`: a slab of `capacity`
    rows per full-attention layer, a window view per sliding one (memrad.engine.state.window),
    a recurrent layer's conv and recurrent state (memrad.engine.state.recurrent), all
    made by `make(shape, dtype, device)`; and the window views (their rows are symbolic). A
    view's example rows (`view_rows`, else 3 if `length` is 2, else 2) differ from `length` so
    that export never takes the two sizes for one; a view is cut from a buffer of the window's
    real rows, since the compiled code is made for the strides it is shown. A layer's rows have its
    own KV heads and head dim where they differ by kind (Gemma 4); a KV-shared layer (Gemma 4)
    is handed an empty pair (memrad.engine.state.shared.SharedLayer)."""
    param = _param(step)
    rows_dtype = rows_dtype_of(step)
    keys, values, windowed = [], [], []
    for layer, window, state in zip(step.layers, steps.windows(step), steps.recurrent(step)):
        if state:  # a spec per argument: (shape, dtype), or a list of them for a pair (FalconH1)
            pair = [tuple(make(*one, param.device) for one in spec) if isinstance(spec, list)
                    else make(*spec, param.device) for spec in layer.state_shapes(param.dtype, capacity)]
        elif getattr(layer, "shared", False):
            pair = [SharedLayer().step_buffers(length - 1)[0] for _ in range(2)]
        elif window is None:
            kv_heads, head_dim = _rows_shape(layer, config)
            pair = [make((1, kv_heads, capacity, head_dim), rows_dtype, param.device) for _ in range(2)]
        else:
            kv_heads, head_dim = _rows_shape(layer, config)
            rows = view_rows or (3 if length == 2 else 2)
            pair = [make((1, kv_heads, buffer_rows(window), head_dim), rows_dtype, param.device)[:, :, :rows]
                    for _ in range(2)]
        keys.append(pair[0])
        values.append(pair[1])
        if window is not None:
            windowed.extend(pair)
    return keys, values, windowed


def rows_dtype_of(step: Any) -> torch.dtype:
    """The dtype of the KV rows `step` is handed: its `kv_dtype` (the llama-shaped and Gemma 3
    steps: memrad.engine.model.kv_dtype), else its weights'."""
    return getattr(step, "kv_dtype", None) or _param(step).dtype


def _rows_shape(layer: Any, config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of an attention layer's rows: the step's layer's own (Gemma 4: per
    kind), else the config's."""
    return (layer.kv_heads, layer.head_dim) if hasattr(layer, "kv_heads") else steps.kv_shape(config)


def _untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _param(step: Any) -> torch.Tensor:
    return next(step.parameters())


def prune(directory: Path, keep: int = KEEP_PACKAGES) -> list[Path]:
    """Delete all but the `keep` most recently used packages (and their constants) in
    `directory`: each torch, model or code change writes a new one (4-8 MB) and nothing
    else would ever remove the old. `load` marks a package used. Staging files whose builder
    no longer runs (a build killed mid-way), or an hour old (its pid reused), are a build that
    never finished. Returns what went."""
    packages = sorted(directory.glob("decode-step-*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    gone = [p for p in packages if ".partial." not in p.name][keep:]
    for package in gone:
        constants_path(package).unlink(missing_ok=True)
        package.unlink(missing_ok=True)
    abandoned = [p for p in directory.glob("decode-step-*.partial*")
                 if not _builder_runs(p.name) or time.time() - p.stat().st_mtime > 3600]
    for staging in abandoned:
        staging.unlink(missing_ok=True)
    return gone + abandoned


def _builder_runs(name: str) -> bool:
    """Whether the process named in a staging file (`<stem>.<pid>.partial[.pt2]`) still runs."""
    field = name.split(".partial")[0].rsplit(".", 1)[-1]
    return not field.isdigit() or pid_alive(int(field))


class _Exported(nn.Module):
    """The step with `owner` and `kernel` bound: export takes tensors (and lists of them) only."""

    def __init__(self, step: DecodeStep, kernel: bool) -> None:
        super().__init__()
        self.step, self.kernel = step, kernel

    def forward(self, token, position, rows, keys, values):
        return self.step(token, position, rows, keys, values, self.step.owner, self.kernel)


def _twin(step: DecodeStep) -> DecodeStep:
    """A copy of the step's modules over the same tensors. Export swaps a module's weights
    for fake tensors while it traces; on the twin, the eager step keeps serving meanwhile."""
    return copy.deepcopy(step, {id(tensor): tensor for tensor in _constants(step).values()})


def _constants(step: DecodeStep) -> dict[str, torch.Tensor]:
    """Every weight and buffer of the step under the name the exported graph gives it."""
    named = [*step.named_parameters(prefix="step", remove_duplicate=False),
             *step.named_buffers(prefix="step", remove_duplicate=False)]
    return dict(named)


def _key(step: DecodeStep, config: Any, capacity: int, kernel: bool, rows: int | None = None) -> str:
    import transformers

    digest = hashlib.sha256()
    for part in (_LAYOUT, torch.__version__, transformers.__version__, torch.backends.cpu.get_cpu_capability(),
                 _cpu_flags(), capacity, decode_step.SPLIT_ROWS, kernel, rows_dtype_of(step),
                 config.to_json_string(use_diff=False)):
        digest.update(f"{part}\n".encode())
    kernel_source = [decode_attention.__file__, decode_attention.SOURCE] if kernel else []
    if rows:  # the batched step: its code and row count (the one-row step's key is unchanged)
        digest.update(f"rows {rows}\n".encode())
        kernel_source.append(batch_step.__file__)
    if any(isinstance(m, block_linear.BlockLinear) for m in step.modules()):  # memra::block_gemv is called by name
        kernel_source += [block_linear.__file__, block_gemv.__file__, block_gemv.SOURCE]
    # Every step module (a new architecture's file included), and window_state: the window
    # views' strides (buffer_rows) are compiled in.
    steps = sorted(Path(decode_step.__file__).parent.glob("*.py"))
    for source in (*steps, window_state.__file__, quant.__file__, __file__, recurrent_state.__file__, *kernel_source):
        digest.update(Path(source).read_bytes())
    for name, module in step.named_modules():
        # a BlockLinear's kind is compiled into the call (plain and interleaved blocks: one shape)
        kind = f" kind {module.kind}" if isinstance(module, block_linear.BlockLinear) else ""
        digest.update(f"{name} {type(module).__module__}.{type(module).__qualname__}{kind}\n".encode())
    for name, tensor in sorted(_constants(step).items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)} {tensor.stride()}\n".encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags: the library is compiled for this CPU (-march=native)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)

