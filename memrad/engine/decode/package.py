"""The decode step compiled ahead of time (AOTInductor): built once, loaded by later starts.

torch.compile traces the step again in every process (dynamo re-traces the default model's two
30-layer graphs, seconds of every start) even when inductor's caches hold the compiled code. An
AOTInductor package is the compiled code itself: `torch.export` captures each graph once,
inductor compiles it into a shared library, and a later start only opens the library
(milliseconds; measured: docs/BENCHMARKS.md, Startup and compile; why: docs/ARCHITECTURE.md,
"The decode step").

    compile/decode-step-{model}-{weights}-{dtype}-attn-{memra|torch}-torch{version}-{cpu}-{key}.pt2
        with memra's attention kernel (memrad.engine.decode.cpu_attention):
            graph "kernel" attended length in [2, capacity - 2]
                           (Gemma 3: and the sliding layers' window rows in [2, W], a second size)
        with torch's attention:
            graph "short"  attended length in [2, SPLIT_ROWS - 1]
            graph "split"  attended length in [SPLIT_ROWS, capacity - 2]   (if the slabs reach it)
    ...{key}.constants.safetensors
        the constants inductor made itself (the int4 op's group size, as a tensor per call)

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memrad.engine.decode import cpu_attention
from memrad.engine.decode import falcon_h1_step, gated_delta, gemma_step, mamba2, qwen3_next_step, steps
from memrad.engine.decode import step as decode_step
from memrad.engine.model import block_linear, quant
from memrad.engine.decode.step import DecodeStep, attended_rows
from memrad.engine.state.kv import MAX_RESERVED_TOKENS
from memrad.engine.state import recurrent as recurrent_state
from memrad.engine.state import window as window_state
from memrad.engine.state.window import buffer_rows
from memrad.faultpoint import kill_point

# What AOTInductor is asked for: the weights stay out of the library (supplied at load), and
# the constants it makes itself come back to the caller so they can be kept beside it.
_AOTI_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}
_LAYOUT = "1"  # of the files this module writes; bump when it changes
KEEP_PACKAGES = 8  # in the compile cache: several models and configurations side by side


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


def package_path(step: DecodeStep, config: Any, capacity: int, kernel: bool, directory: Path) -> Path:
    """Where the package for this step, model config, slab capacity and attention (`kernel`:
    memra's) lives in `directory`."""
    weights = "int4" if any(isinstance(m, (quant.Int4Linear, block_linear.BlockLinear)) for m in step.modules()) else "float"
    dtype = str(_param(step).dtype).removeprefix("torch.")
    label = Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model"
    attention = "memra" if kernel else "torch"
    return directory / (f"decode-step-{_safe(label)}-{weights}-{dtype}-attn-{attention}-torch{_safe(torch.__version__)}-"
                        f"{torch.backends.cpu.get_cpu_capability().lower()}-{_key(step, config, capacity, kernel)}.pt2")


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
        self._slab = next((i for i, (window, state) in enumerate(zip(windows, steps.recurrent(eager)))
                           if window is None and not state), None)
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


def load(step: DecodeStep, capacity: int, kernel: bool, path: Path) -> PackagedStep:
    """Open the package at `path` for `step`, handing it the step's own tensors (no copy).
    With `kernel`, memra's attention kernel must be loaded already (cpu_attention.load).

    Uses torch's C++ loader directly: `torch._inductor.aoti_load_package` does the same
    after importing inductor's Python side, which a start does not need (its cost:
    docs/BENCHMARKS.md, Startup and compile)."""
    from safetensors.torch import load_file

    made = load_file(str(constants_path(path)))  # {"graph/name": tensor}
    os.utime(path)  # used now: `prune` keeps the most recently used
    state = _constants(step)
    runners = {}
    for graph in graph_ranges(capacity, kernel):
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), graph, False, 1, -1)
        fqns = runner.get_constant_fqns()
        supplied = {fqn: state[fqn] if fqn in state else made[f"{graph}/{fqn}"] for fqn in fqns}
        # (use_inactive, check_full_update, user_managed, allow_h2d_copy)
        runner.load_constants(supplied, False, True, True, False)
        runners[graph] = runner
    return PackagedStep(step, runners, made, capacity, kernel)


def build(step: DecodeStep, config: Any, capacity: int, kernel: bool, path: Path) -> None:
    """Export the step's graphs, compile them with AOTInductor and write the package and its
    constants at `path` (atomically: a package is only ever there complete). Minutes."""
    from safetensors.torch import save_file
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    exported = _Exported(_twin(step), kernel)
    files, weights = {}, {}
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
        compiled = aot_compile(program.module(check_guards=False), *program.example_inputs, options=_AOTI_OPTIONS)
        files[graph] = [item for item in compiled if isinstance(item, str)]
        weights[graph] = {name: tensor for item in compiled if not isinstance(item, str)
                          for name, (tensor, _) in item.items()}
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
        os.replace(staged_constants, constants_path(path))
        kill_point("package-rename")
        os.replace(staging, path)
    finally:  # a failed build leaves nothing behind
        staging.unlink(missing_ok=True)
        staged_constants.unlink(missing_ok=True)
    prune(path.parent)


def example_buffers(step: Any, config: Any, capacity: int, length: int, make: Any
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values as the step is handed them at attended `length`: a slab of `capacity`
    rows per full-attention layer, a window view per sliding one (memrad.engine.state.window),
    a recurrent layer's conv and recurrent state (memrad.engine.state.recurrent), all
    made by `make(shape, dtype, device)`; and the window views (their rows are symbolic). A
    view's example rows differ from `length` (3 if it is 2, else 2) so that export never takes
    the two sizes for one; a view is cut from a buffer of the window's real rows, since the
    compiled code is made for the strides it is shown."""
    kv_heads, head_dim = steps.kv_shape(config)
    param = _param(step)
    keys, values, windowed = [], [], []
    for layer, window, state in zip(step.layers, steps.windows(step), steps.recurrent(step)):
        if state:  # a spec per argument: (shape, dtype), or a list of them for a pair (FalconH1)
            pair = [tuple(make(*one, param.device) for one in spec) if isinstance(spec, list)
                    else make(*spec, param.device) for spec in layer.state_shapes(param.dtype, capacity)]
        elif window is None:
            pair = [make((1, kv_heads, capacity, head_dim), param.dtype, param.device) for _ in range(2)]
        else:
            rows = 3 if length == 2 else 2
            pair = [make((1, kv_heads, buffer_rows(window), head_dim), param.dtype, param.device)[:, :, :rows]
                    for _ in range(2)]
        keys.append(pair[0])
        values.append(pair[1])
        if window is not None:
            windowed.extend(pair)
    return keys, values, windowed


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
    from memrad.daemon import pid_alive

    field = name.split(".partial")[0].rsplit(".", 1)[-1]
    return not field.isdigit() or pid_alive(int(field))


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to load the model a step was made from, so another process can build its package:
    the loader's arguments for the model as the daemon loaded it."""

    folder: str
    dtype: str  # "bfloat16", "float32", ...
    weights: str  # "int4", "float", ...
    context_len: int


_children: set[subprocess.Popen] = set()  # builds running now (`stop_children`)


class BuildKilled(RuntimeError):
    """The build's child died of a signal (`memrad stop`, the OOM killer, a user's kill):
    not a sign that AOTInductor cannot compile the step, so no fallback is tried."""


def build_in_child(recipe: Recipe, kernel: bool, path: Path, timeout_s: float = 1800) -> None:
    """`build` in a child process that loads the model itself. Export and inductor are
    Python-heavy: on the daemon's own interpreter they held the GIL against the engine thread,
    and a reply served meanwhile decoded at a small fraction of its speed (measured:
    docs/BENCHMARKS.md, Decode: the step's parts). The child runs one torch thread, leaving the
    other core to serving. Raises
    RuntimeError with the child's last lines if it fails."""
    args = [sys.executable, "-m", "memrad.engine.decode.package", recipe.folder, recipe.dtype, recipe.weights,
            str(recipe.context_len), "kernel" if kernel else "torch", str(path)]
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    _children.add(child)
    try:
        _, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise RuntimeError(f"building the package took more than {timeout_s:.0f} s") from None
    finally:
        _children.discard(child)
    if child.returncode < 0:
        raise BuildKilled(f"the package build was killed (signal {-child.returncode})")
    if child.returncode != 0:
        last = [line for line in err.splitlines() if line.strip()][-1:] or [f"exit {child.returncode}"]
        raise RuntimeError(f"the package build exited with {child.returncode}: {last[0][:300]}")


def stop_children() -> None:
    """Stop builds still running (at `memrad stop`): a stopped daemon leaves no work behind."""
    for child in list(_children):
        child.kill()


def main(argv: list[str]) -> int:
    """The child of `build_in_child`: load the model as the daemon did, build the package."""
    from memrad.engine.model.loader import load_model

    folder, dtype, weights, context_len, attention, path = argv
    kernel = attention == "kernel"
    torch.set_num_threads(1)
    loaded = load_model(folder, device="cpu", dtype=dtype, weights=weights, allow_pull=False,
                        progress=lambda _: None, context=int(context_len))
    if kernel and cpu_attention.load(cpu_attention.cxx_compiler()) is not None:
        print("memra's attention kernel is not available to the child", file=sys.stderr)
        return 2
    capacity = min(int(context_len), MAX_RESERVED_TOKENS)
    step = steps.new_step(loaded.model, int(context_len))
    mine = package_path(step, loaded.model.config, capacity, kernel, Path(path).parent)
    if mine != Path(path):  # another load would make another step: never build it under this name
        print(f"the child's step is {mine.name}, not {Path(path).name}", file=sys.stderr)
        return 3
    build(step, loaded.model.config, capacity, kernel, Path(path))
    return 0


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


def _key(step: DecodeStep, config: Any, capacity: int, kernel: bool) -> str:
    import transformers

    digest = hashlib.sha256()
    for part in (_LAYOUT, torch.__version__, transformers.__version__, torch.backends.cpu.get_cpu_capability(),
                 _cpu_flags(), capacity, decode_step.SPLIT_ROWS, kernel, config.to_json_string(use_diff=False)):
        digest.update(f"{part}\n".encode())
    kernel_source = [cpu_attention.__file__, cpu_attention.SOURCE] if kernel else []
    if any(isinstance(m, block_linear.BlockLinear) for m in step.modules()):  # memra::block_gemv is called by name
        kernel_source += [block_linear.__file__, block_linear.source()]
    # window_state: the window views' strides (buffer_rows) are compiled in.
    for source in (decode_step.__file__, gemma_step.__file__, window_state.__file__, quant.__file__, __file__,
                   qwen3_next_step.__file__, gated_delta.__file__, falcon_h1_step.__file__, mamba2.__file__,
                   recurrent_state.__file__, *kernel_source):
        digest.update(Path(source).read_bytes())
    for name, module in step.named_modules():
        digest.update(f"{name} {type(module).__module__}.{type(module).__qualname__}\n".encode())
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
