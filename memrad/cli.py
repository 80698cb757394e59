"""memrad start | stop | status | logs | pull."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from memrad import __version__
from memrad.config import Settings, SettingsError, known_keys, load_settings
from memrad.daemon import (DETACHED_ENV, AlreadyRunning, DaemonInfo, StartupError, StopReport, find_running,
                            is_memrad, lock_holder)
from memrad.paths import UnsafeRuntimeDir, log_path, pidfile_path, runtime_dir_note, stop_report_path
from memrad.private import open_private
from memrad.process import pid_alive

START_TIMEOUT_S = 900.0

# Flag -> setting. Flags beat MEMRA_* variables, which beat config files.
FLAGS = {
    "model": "model.name",
    "host": "server.host",
    "port": "server.port",
    "device": "model.device",
    "dtype": "model.dtype",
    "threads": "model.threads",
    "weights": "model.weights",
    "kv_dtype": "model.kv_dtype",
    "context": "model.context",
    "prefill_chunk": "engine.prefill_chunk",
    "compile": "engine.compile",
    "reuse_mode": "reuse.mode",
    "max_queue": "server.max_queue",
    "max_batch": "server.max_batch",
    "log_level": "log.level",
    "record": "control.record",
    "api_key": "security.api_key",
    "allow_remote_without_key": "security.allow_remote_without_key",
    "longest_prefix": "affinity.longest_prefix",
}

# `memrad bench NAME` -> the module under memrad.bench that runs it (each has main(argv)).
BENCH_HARNESSES = {"record": "record", "replay": "replay", "chunk-probe": "chunk_probe", "fuzz": "fuzz",
                   "faults": "faults", "plan-cost": "plan_cost", "sharing": "sharing",
                   "speed": "speed", "spill-ttft": "spill_ttft", "interleaved": "interleaved_turns",
                   "concurrent": "concurrent", "weights": "weight_formats", "step-bits": "step_bits",
                   "arch-steps": "arch_steps", "build-phases": "build_phases",
                   "contended": "contended", "draft-index": "draft_index",
                   "draft-replay": "draft_replay", "rows": "rows", "experts": "experts"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memrad", description="memra's inference daemon")
    parser.add_argument("--version", action="version", version=f"memrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="start the daemon (in the background unless --foreground)")
    start.add_argument("--foreground", action="store_true", help="run attached to this terminal")
    start.add_argument("--config", type=Path, help="config file (default: the user config dir's memrad.toml)")
    start.add_argument("--model", help="`default`, `gemma3-270m`, a local Hugging Face folder, or a .gguf file")
    start.add_argument("--host")
    start.add_argument("--port", type=int)
    start.add_argument("--device", choices=("auto", "cpu", "cuda"))
    start.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    start.add_argument("--threads", type=int, help="torch intra-op threads (0: all available cores)")
    start.add_argument("--weights", choices=("auto", "float", "int4", "int8"),
                       help="decode weights: int4 runs a GGUF's 4-bit blocks as shipped (auto where present)")
    start.add_argument("--kv-dtype", choices=("auto", "activations", "bfloat16"),
                       help="KV cache rows: auto keeps bf16 rows under fp32 activations where the decode step reads "
                            "them on memra's kernel (half a long context's bytes), activations keeps their dtype")
    start.add_argument("--context", type=int,
                       help="tokens served (prompt + reply); past the model's native length RoPE scaling "
                            "(YaRN) extends it (0: the model's default; the default model serves 32768)")
    start.add_argument("--prefill-chunk", type=int, help="prefill chunk size: the canonical grid step")
    start.add_argument("--compile", choices=("auto", "wait", "on", "off"),
                       help="decode step: auto compiles it in the background and serves eager meanwhile, wait too "
                            "but replies wait for it (the same bits every start), on before serving, off stays eager")
    start.add_argument("--reuse-mode", choices=("exact", "fast"),
                       help="exact: resumed turns are bit-identical to cold runs; fast: reuse everything parked")
    start.add_argument("--longest-prefix", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the longest common prefix with any parked session (MEMRA_LONGEST_PREFIX)")
    start.add_argument("--max-queue", type=int, help="requests that may wait for the model")
    start.add_argument("--max-batch", type=int, help="requests on the model together (1: one at a time)")
    start.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    start.add_argument("--record", help="append the control socket's events to this JSONL file")
    start.add_argument("--api-key", help="require this key (Bearer or x-api-key) on every route but /health")
    start.add_argument("--allow-remote-without-key", action="store_const", const=True,
                       help="INSECURE: listen on a non-loopback --host without an API key")

    stop = sub.add_parser("stop", help="stop the daemon gracefully")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds before it is killed")

    status = sub.add_parser("status", help="is it running, where, on what; parked sessions on disk per model")
    status.add_argument("--json", action="store_true")

    cache = sub.add_parser("cache", help="the disk tier of parked sessions")
    cache_sub = cache.add_subparsers(dest="action", required=True)
    clear = cache_sub.add_parser("clear", help="delete the parked sessions on disk (of every model, or one)")
    clear.add_argument("--model", help="only this model's sessions (its name as `memrad status` shows it)")

    logs = sub.add_parser("logs", help="print the daemon's log")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("-n", "--lines", type=int, default=100, help="last N lines (0: all)")

    pull = sub.add_parser("pull", help="fetch and convert a model into the cache")
    pull.add_argument("model", nargs="?", default="default", help="`default`, `gemma3-270m` or a .gguf file")

    models = sub.add_parser("models", help="the named models: which are pulled, their size on disk, their context")
    models.add_argument("--json", action="store_true")

    sub.add_parser("smoke", help="prove reuse fires end to end and resumes reproducibly (two fresh daemons)")
    bench = sub.add_parser("bench", help="benchmark harnesses (see docs/BENCHMARKS.md)")
    bench.add_argument("harness", choices=tuple(BENCH_HARNESSES))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the harness's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "cache": cmd_cache,
                "logs": cmd_logs, "pull": cmd_pull, "models": cmd_models, "smoke": cmd_smoke,
                "bench": cmd_bench}[args.command](args)
    except (SettingsError, AlreadyRunning, StartupError, UnsafeRuntimeDir) as exc:
        print(f"memrad: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SettingsError) else 1
    except KeyboardInterrupt:
        return 130


def _flag_overrides(args: argparse.Namespace) -> dict:
    return {key: getattr(args, flag) for flag, key in FLAGS.items() if getattr(args, flag) is not None}


def cmd_start(args: argparse.Namespace) -> int:
    settings = load_settings(_flag_overrides(args), config_file=args.config)
    from memrad.server.security import bind_refusal

    refused = bind_refusal(settings.security, settings.server.host)
    if refused is not None:
        raise StartupError(refused)
    running = find_running()
    if running is not None:
        where = running.url or "still loading its model"
        print(f"memrad is already running (pid {running.pid}, {where}); `memrad stop` stops it")
        return 0
    note = runtime_dir_note()
    if note is not None:
        print(f"memrad: {note}", file=sys.stderr)
    if not _said_before_the_wait(settings.model.name, settings):
        return 1
    if args.foreground:
        return _run_foreground(settings)
    return _start_detached(args, settings)


def _said_before_the_wait(spec: str, settings: Settings) -> bool:
    """For a .gguf file: print what it will be served as (memrad.engine.model.preflight), before
    any weight is read; False (after saying why) when memrad cannot serve it."""
    path = Path(spec).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return True
    from memrad.engine.model.loader import pick_device, pick_dtype
    from memrad.engine.model.preflight import inspect_gguf
    from memrad.engine.model.unavailable import ModelUnavailable

    try:
        device = pick_device(settings.model.device)
        dtype = pick_dtype(settings.model.dtype, device)
        preflight = inspect_gguf(path, settings.model.context, dtype, settings.model.weights, device.type)
    except ModelUnavailable as exc:
        print(f"memrad: {exc}", file=sys.stderr)
        return False
    print("\n".join(preflight.lines()), flush=True)
    return True


def _run_foreground(settings: Settings) -> int:
    from memrad.daemon import configure_logging, serve
    from memrad.engine.model.unavailable import ModelUnavailable

    configure_logging(settings.log.level, detached=os.environ.get(DETACHED_ENV) == "1",
                      max_bytes=settings.log.max_bytes, backups=settings.log.backups)
    try:
        unsaved = serve(settings)
    except ModelUnavailable as exc:
        import logging

        logging.getLogger("memrad").error("%s", exc)
        return 1
    except StartupError as exc:
        import logging

        logging.getLogger("memrad").error("%s", exc)
        return 1
    return 1 if unsaved else 0


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    """Flags travel to the detached child as MEMRA_* variables (flags > env, so the order holds)."""
    env = dict(os.environ)
    keys = known_keys()
    for key, value in _flag_overrides(args).items():
        env[keys[key].metadata["env"]] = str(value)
    if args.config is not None:
        env["MEMRA_CONFIG"] = str(args.config.resolve())
    env[DETACHED_ENV] = "1"
    return env


def _start_detached(args: argparse.Namespace, settings: Settings) -> int:
    if settings.model.name == "default":
        from memrad.engine.model.pull import ModelUnavailable, default_model_dir, is_converted, pull_default

        if not is_converted(default_model_dir()):
            print("first start: fetching the default model (SmolLM2-135M-Instruct)")
            try:
                pull_default(print)
            except ModelUnavailable as exc:
                print(f"memrad: {exc}", file=sys.stderr)
                return 1
    log_file = log_path()
    start_offset = log_file.stat().st_size if log_file.exists() else 0
    with open_private(log_file, "ab", tighten_dir=True) as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "memrad", "start", "--foreground"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_child_env(args),
            start_new_session=True,
        )
    return _wait_until_serving(child, log_file, start_offset)


def _wait_until_serving(child: subprocess.Popen, log_file: Path, offset: int) -> int:
    interactive = sys.stdout.isatty()
    deadline = time.monotonic() + START_TIMEOUT_S
    last_line = ""
    while time.monotonic() < deadline:
        if child.poll() is not None:
            _clear(interactive)
            print(f"memrad: the daemon exited during startup (code {child.returncode}). "
                  f"Last lines of {log_file}:", file=sys.stderr)
            for line in _new_lines(log_file, offset)[-15:]:
                print(f"  {line}", file=sys.stderr)
            return 1
        info = DaemonInfo.read(pidfile_path())
        health = _health(info.url) if info is not None and info.pid == child.pid and info.url else None
        if health is not None:
            _clear(interactive)
            print(f"memrad is serving {health['model']} at {info.url}/v1")
            print(f"  device {health['device']} ({health['dtype']}), pid {health['pid']}, log {log_file}")
            decode = health.get("choices", {}).get("decode")
            if decode:  # a first start: the compiled step still building, and what serves meanwhile
                print(f"  decode {decode['value']}: {decode['reason']}")
            return 0
        lines = _new_lines(log_file, offset)
        if lines and lines[-1] != last_line:
            last_line = lines[-1]
            message = last_line.split(": ", 1)[-1][:100]
            if interactive:
                print(f"\r\033[K  {message}", end="", flush=True)
            else:
                print(f"  {message}", flush=True)
        time.sleep(0.05)  # the wait is what a start costs the user: poll often, it is cheap
    _clear(interactive)
    print(f"memrad: the daemon did not answer within {START_TIMEOUT_S:.0f} s; see `memrad logs`",
          file=sys.stderr)
    return 1


def _clear(interactive: bool) -> None:
    if interactive:
        print("\r\033[K", end="", flush=True)


def _new_lines(log_file: Path, offset: int) -> list[str]:
    try:
        with open(log_file, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _health(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def cmd_stop(args: argparse.Namespace) -> int:
    info = find_running()
    if info is None:
        print("memrad is not running")
        return 0
    if info.pid <= 0:
        print("memrad is starting up; try `memrad stop` again in a moment", file=sys.stderr)
        return 1
    if not is_memrad(info.pid):
        if find_running() is None:  # it exited between the two looks
            print("memrad is not running")
            return 0
        holder = lock_holder()
        print(f"memrad: the pidfile names pid {info.pid}, which is not the memrad daemon"
              f"{f' (pid {holder} holds the lock)' if holder else ''}; not signalling it. "
              f"If no memrad runs, remove {pidfile_path()}", file=sys.stderr)
        return 1
    _signal(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not pid_alive(info.pid) or find_running() is None:
            report = StopReport.take(stop_report_path(), info.pid)
            if report is not None and report.unsaved:
                print(f"memrad stopped (pid {info.pid}), but {len(report.unsaved)} parked sessions were not "
                      "saved to the disk tier and are lost:", file=sys.stderr)
                for line in report.unsaved:
                    print(f"  {line}", file=sys.stderr)
                return 1
            print(f"memrad stopped (pid {info.pid})")
            return 0
        time.sleep(0.1)
    if is_memrad(info.pid):  # still the daemon, not a new process that got its pid
        _signal(info.pid, signal.SIGKILL)
    time.sleep(0.2)
    find_running()  # cleans the files the killed process left
    print(f"memrad did not stop within {args.timeout:.0f} s and was killed (pid {info.pid})", file=sys.stderr)
    return 1


def _signal(pid: int, sig: int) -> None:
    """A daemon that exits between the check and the signal is simply gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def cmd_status(args: argparse.Namespace) -> int:
    info = find_running()
    health = _health(info.url) if info is not None and info.url else None
    if info is None:
        report = {"running": False}
    else:
        report = {"running": True, "pid": info.pid, "url": info.url, "log": info.log,
                  "socket": info.socket, "state": "serving" if health else "starting"}
        if health:
            report.update({k: health[k] for k in ("model", "device", "dtype", "uptime_s",
                                                   "requests_served", "waiting", "version")})
            report["choices"] = health.get("choices", {})
    directory, by_model = _disk_by_model()
    report["disk"] = {"dir": str(directory), "models": by_model}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["running"] else 3
    if not report["running"]:
        print("memrad is not running (`memrad start` starts it)")
    elif not health:
        print(f"memrad is starting (pid {info.pid}); `memrad logs -f` shows progress")
    else:
        print(f"memrad {report['version']}: serving")
        print(f"  pid       {report['pid']}")
        print(f"  url       {report['url']}/v1")
        print(f"  model     {report['model']}")
        print(f"  device    {report['device']} ({report['dtype']})")
        for name, choice in report["choices"].items():
            print(f"  {name:<9} {choice['value']}: {choice['reason']}")
        print(f"  uptime    {_duration(report['uptime_s'])}")
        print(f"  requests  {report['requests_served']} served, {report['waiting']} waiting")
        print(f"  log       {report['log']}")
        print(f"  socket    {report['socket']}")
    print(f"  on disk   {directory}" + ("" if by_model else " (no parked sessions)"))
    for model, figures in by_model.items():
        print(f"    {figures['sessions']:>4} sessions  {figures['bytes'] / 2**20:8.1f} MiB  {model}")
    return 0 if report["running"] else 3


def _sessions_dir() -> Path:
    from memrad.paths import sessions_dir

    settings = load_settings({})
    return Path(settings.disk.dir).expanduser() if settings.disk.dir else sessions_dir()


def _disk_by_model() -> tuple[Path, dict[str, dict[str, int]]]:
    """The disk tier's parked sessions and bytes per model, from the files' headers alone
    (unusable files under "(unusable)": the next start deletes them)."""
    from memrad.engine.state.sessionfile import scan

    directory = _sessions_dir()
    by_model: dict[str, dict[str, int]] = {}
    for f in scan(directory):
        figures = by_model.setdefault(f.model or "(unusable)", {"sessions": 0, "bytes": 0})
        figures["sessions"] += 1
        figures["bytes"] += f.num_bytes
    return directory, dict(sorted(by_model.items()))


def cmd_cache(args: argparse.Namespace) -> int:
    """`memrad cache clear [--model NAME]`: refused while a daemon runs (its stop writes its
    parked sessions back, and it may be loading one now)."""
    from memrad.engine.state.sessionfile import clear

    running = find_running()
    if running is not None:
        print(f"memrad: a daemon is running (pid {running.pid}); `memrad stop` it first, since it writes "
              "its parked sessions to disk when it stops", file=sys.stderr)
        return 1
    directory = _sessions_dir()
    gone = clear(directory, args.model)
    if not gone:
        _, by_model = _disk_by_model()
        others = f" (on disk: {', '.join(by_model)})" if by_model else ""
        print(f"no parked sessions{f' of {args.model}' if args.model else ''} in {directory}{others}")
        return 0
    print(f"deleted {len(gone)} parked sessions ({sum(f.num_bytes for f in gone) / 2**20:.1f} MiB)"
          f"{f' of {args.model}' if args.model else ''} from {directory}")
    return 0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def cmd_logs(args: argparse.Namespace) -> int:
    path = log_path()
    if not path.exists():
        print(f"no log yet at {path} (`memrad start` writes it)", file=sys.stderr)
        return 1
    handle = open(path, "rb")
    lines = handle.read().decode(errors="replace").splitlines()
    rotated = path.with_name(path.name + ".1")  # the log is rotated by size (memrad.daemon)
    if (args.lines == 0 or len(lines) < args.lines) and rotated.exists():
        lines = rotated.read_bytes().decode(errors="replace").splitlines() + lines
    shown = lines if args.lines == 0 else deque(lines, maxlen=args.lines)
    for line in shown:
        print(line)
    if not args.follow:
        handle.close()
        return 0
    sys.stdout.flush()
    while True:
        chunk = handle.read()
        if chunk:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            continue
        try:
            renewed = os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino
        except OSError:
            renewed = False
        if renewed:  # rotated: what is left of the old file was read above; follow the new one
            handle.close()
            handle = open(path, "rb")
        else:
            time.sleep(0.25)


def cmd_pull(args: argparse.Namespace) -> int:
    from memrad.engine import kernels
    from memrad.engine.model import catalog
    from memrad.engine.model.pull import ModelUnavailable, pull_gguf, pull_named

    try:
        entry = catalog.lookup(args.model)
        if entry is not None:
            folder = pull_named(entry, print)
        else:
            path = Path(args.model).expanduser()
            if path.suffix != ".gguf" or not path.is_file():
                print(f"memrad: pull takes {catalog.names()} or a .gguf file; a model folder needs no pull",
                      file=sys.stderr)
                return 2
            if not _said_before_the_wait(str(path), load_settings()):
                return 1
            folder = pull_gguf(path, print)
    except ModelUnavailable as exc:
        print(f"memrad: {exc}", file=sys.stderr)
        return 1
    print(f"ready: {folder}")
    kernels.prepare()
    _build_decode_step(args.model if entry is not None else str(path))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """The catalog against the cache: what is pulled (and its size), what `memrad pull NAME` fetches."""
    from memrad.engine.model import catalog
    from memrad.engine.model.pull import bytes_on_disk, is_converted, model_dir

    rows = []
    for entry in catalog.CATALOG.values():
        folder = model_dir(entry)
        pulled = is_converted(folder)
        rows.append({"name": entry.name, "model_id": entry.model_id, "pulled": pulled,
                     "bytes_on_disk": bytes_on_disk(folder) if pulled else 0, "folder": str(folder),
                     "download": entry.download_size, "native_context": entry.native_context,
                     "served_context": entry.served_context, "summary": entry.summary})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<13} {'pulled':<16} {'context':<26} model")
    for row in rows:
        state = f"yes, {row['bytes_on_disk'] / 2**20:,.0f} MiB" if row["pulled"] else f"no ({row['download']})"
        native, served = row["native_context"], row["served_context"]
        context = f"{served:,}" + (f" (native {native:,})" if served != native else " (native)")
        print(f"{row['name']:<13} {state:<16} {context:<26} {row['summary']}")
    print("`memrad pull NAME` fetches one; `memrad start --model NAME` serves it")
    return 0


def _build_decode_step(spec: str) -> None:
    """Build the compiled decode step for `spec` as `memrad start` will serve it (the
    configured device, dtype, weights and context), so a first start decodes compiled from
    its first token (it would serve eager until its own build lands, and an eager step can
    answer differently: docs/ARCHITECTURE.md, "The decode step"), the batched packages too
    (a start builds them only when a second request first decodes beside another). Each
    build is announced with the last such build's time here, then shows its phase: a bar
    redrawn each second on a terminal (`_Ticker`), a line a phase elsewhere."""
    settings = load_settings({})
    if settings.engine.compile == "off":
        return
    from memrad.engine import speculation
    from memrad.engine.decode.decoder import Decoder
    from memrad.engine.decode.builder import Recipe
    from memrad.engine.model.loader import load_model

    loaded = load_model(spec, settings.model.device, settings.model.dtype, progress=lambda _: None,
                        allow_pull=False, weights=settings.model.weights, context=settings.model.context,
                        kv_dtype=settings.model.kv_dtype)
    recipe = Recipe.of(loaded)
    # The batched step's package too where the settings decode batched (a start would build it).
    batch_rows = settings.server.max_batch if settings.engine.batch_decode == "batched" else None
    run_rows = speculation.RUN_ROWS if settings.engine.speculate == "auto" else None
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device, "auto", recipe, batch_rows=batch_rows,
                      run_rows=run_rows)
    with _Ticker() as ticker:
        said = decoder.prepare(ticker.building)
    print(f"decode step: {said}")


class _Ticker:
    """Prints each build as it starts ('building the decode step (one row, ...): ~97 s (the last
    build here)'); then, on a terminal, redraws its bar once a second (against that estimate,
    else against its phases: memrad.engine.decode.build_times.Progress.line), and elsewhere
    (a log, a pipe) prints each phase as a line."""

    def __init__(self) -> None:
        self._progress = None  # build_times.Progress of the build under way
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._terminal = sys.stdout.isatty()
        self._thread = threading.Thread(target=self._tick, name="memrad-pull-ticker", daemon=True)

    def __enter__(self) -> "_Ticker":
        if self._terminal:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            print("\r\033[K", end="", flush=True)

    def building(self, progress) -> None:
        from memrad.engine.decode.build_times import PHASES, estimate_of

        with self._lock:
            starts = self._progress is None or progress.what != self._progress.what
            if starts:
                self._since = time.monotonic()
            self._progress = progress
            if self._terminal:
                print("\r\033[K", end="")
            if starts:
                print(f"building {progress.what}: {estimate_of(progress.estimate_s)}", flush=True)
            elif not self._terminal and progress.phase in PHASES:
                print(f"  phase {PHASES.index(progress.phase) + 1}/{len(PHASES)}: {progress.phase}", flush=True)
            if self._terminal:
                self._draw()

    def _draw(self) -> None:
        print(f"\r\033[K  {self._progress.line(time.monotonic() - self._since)}", end="", flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self._progress is not None:
                    self._draw()


def cmd_smoke(args: argparse.Namespace) -> int:
    from memrad.bench.smoke import smoke

    return smoke()


def cmd_bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    # Imported on demand: fuzz and faults need the test extra (hypothesis).
    return import_module(f"memrad.bench.{BENCH_HARNESSES[args.harness]}").main(args.rest)
