"""memrad start | stop | status | logs | pull."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from memrad import __version__
from memrad.config import Settings, SettingsError, known_keys, load_settings
from memrad.daemon import DETACHED_ENV, AlreadyRunning, DaemonInfo, StartupError, find_running, pid_alive
from memrad.paths import log_path, pidfile_path

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
    "prefill_chunk": "engine.prefill_chunk",
    "compile": "engine.compile",
    "reuse_mode": "reuse.mode",
    "max_queue": "server.max_queue",
    "log_level": "log.level",
    "record": "control.record",
    "api_key": "security.api_key",
    "allow_remote_without_key": "security.allow_remote_without_key",
    "longest_prefix": "affinity.longest_prefix",
}

# `memrad bench NAME` -> the module under memrad.bench that runs it (each has main(argv)).
BENCH_HARNESSES = {"record": "record", "replay": "replay", "chunk-probe": "chunk_probe", "fuzz": "fuzz",
                   "faults": "faults", "plan-cost": "plan_cost", "sharing": "sharing",
                   "speed": "speed", "interleaved": "interleaved_turns"}


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
    start.add_argument("--prefill-chunk", type=int, help="prefill chunk size: the canonical grid step")
    start.add_argument("--compile", choices=("auto", "on", "off"),
                       help="decode step: auto compiles it in the background, on before serving, off stays eager")
    start.add_argument("--reuse-mode", choices=("exact", "fast"),
                       help="exact: resumed turns are bit-identical to cold runs; fast: reuse everything parked")
    start.add_argument("--longest-prefix", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the longest common prefix with any parked session (MEMRA_LONGEST_PREFIX)")
    start.add_argument("--max-queue", type=int, help="requests that may wait for the model")
    start.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    start.add_argument("--record", help="append the control socket's events to this JSONL file")
    start.add_argument("--api-key", help="require this key (Bearer or x-api-key) on every route but /health")
    start.add_argument("--allow-remote-without-key", action="store_const", const=True,
                       help="INSECURE: listen on a non-loopback --host without an API key")

    stop = sub.add_parser("stop", help="stop the daemon gracefully")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds before it is killed")

    status = sub.add_parser("status", help="is it running, where, on what")
    status.add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="print the daemon's log")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("-n", "--lines", type=int, default=100, help="last N lines (0: all)")

    pull = sub.add_parser("pull", help="fetch and convert a model into the cache")
    pull.add_argument("model", nargs="?", default="default", help="`default`, `gemma3-270m` or a .gguf file")

    sub.add_parser("smoke", help="prove reuse fires end to end and resumes reproducibly (two fresh daemons)")
    bench = sub.add_parser("bench", help="benchmark harnesses (see docs/BENCHMARKS.md)")
    bench.add_argument("harness", choices=tuple(BENCH_HARNESSES))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the harness's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"start": cmd_start, "stop": cmd_stop, "status": cmd_status,
                "logs": cmd_logs, "pull": cmd_pull, "smoke": cmd_smoke,
                "bench": cmd_bench}[args.command](args)
    except (SettingsError, AlreadyRunning, StartupError) as exc:
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
    if args.foreground:
        return _run_foreground(settings)
    return _start_detached(args, settings)


def _run_foreground(settings: Settings) -> int:
    from memrad.daemon import configure_logging, serve
    from memrad.engine.model.pull import ModelUnavailable

    configure_logging(settings.log.level, detached=os.environ.get(DETACHED_ENV) == "1")
    try:
        serve(settings)
    except ModelUnavailable as exc:
        import logging

        logging.getLogger("memrad").error("%s", exc)
        return 1
    except StartupError as exc:
        import logging

        logging.getLogger("memrad").error("%s", exc)
        return 1
    return 0


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
    with open(log_file, "ab") as out:
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
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not pid_alive(info.pid) or find_running() is None:
            print(f"memrad stopped (pid {info.pid})")
            return 0
        time.sleep(0.1)
    os.kill(info.pid, signal.SIGKILL)
    time.sleep(0.2)
    find_running()  # cleans the files the killed process left
    print(f"memrad did not stop within {args.timeout:.0f} s and was killed (pid {info.pid})", file=sys.stderr)
    return 1


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
    if args.json:
        print(json.dumps(report, indent=2))
    elif not report["running"]:
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
    return 0 if report["running"] else 3


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
    with open(path, "rb") as handle:
        lines = handle.read().decode(errors="replace").splitlines()
        shown = lines if args.lines == 0 else deque(lines, maxlen=args.lines)
        for line in shown:
            print(line)
        if not args.follow:
            return 0
        sys.stdout.flush()
        while True:
            chunk = handle.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.25)


def cmd_pull(args: argparse.Namespace) -> int:
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
            folder = pull_gguf(path, print)
    except ModelUnavailable as exc:
        print(f"memrad: {exc}", file=sys.stderr)
        return 1
    print(f"ready: {folder}")
    _build_attention_kernel()
    return 0


def _build_attention_kernel() -> None:
    """Build the CPU decode-attention kernel now, so a first start decodes with it at once
    (a start would build it in the background otherwise); a failure only loses speed."""
    from memrad.engine.decode import cpu_attention
    from memrad.engine.decode.cpu_attention import cxx_compiler

    compiler = cxx_compiler()
    if compiler is not None and cpu_attention.library_path(compiler).exists():
        return
    print("building the CPU decode-attention kernel (once per machine and torch) ...")
    why_not = cpu_attention.load(compiler)
    print(f"attention kernel: {'built' if why_not is None else f'not built ({why_not}); decode uses torch attention'}")


def cmd_smoke(args: argparse.Namespace) -> int:
    from memrad.bench.smoke import smoke

    return smoke()


def cmd_bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    # Imported on demand: fuzz and faults need the test extra (hypothesis).
    return import_module(f"memrad.bench.{BENCH_HARNESSES[args.harness]}").main(args.rest)
