"""`memrad bench concurrent`: many requests at once, as agent CLIs send them.

    memrad bench concurrent [--agents 1 2 4] [--replies 48 400] [--turns 3] [--prime-lines 440]
                            [--max-batch 4 1] [--batch-decode batched rows] [--threads 2]
                            [--peer LLAMA_SERVER --gguf GGUF]

For each server (a throwaway memrad per --max-batch value, started through the real CLI, and
llama.cpp's llama-server -np 4 on the same GGUF with --peer):

  * N rewriting agents at once (N in --agents), each running --turns turns of its own
    conversation (every earlier reply cut to its first half, as a reasoning-stripping
    client sends it), replies of R tokens (R in --replies; the model may stop sooner: the
    tokens counted are the ones it sent): aggregate decode tok/s (tokens after each first
    one, over the seconds in which any reply was decoding), TTFT median and max over every
    request, wall time.
  * A side query sent while a ~16k-token cold prime runs (--prime-lines lines of a
    repository listing, ~37 tokens each): the side query's TTFT and the prime's.

Streams over HTTP (the openai client), temperature 0. Prints one Markdown table per scenario.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from memrad.bench.affinity_turns import SYSTEM, TOOL_OUTPUT
from memrad.bench.daemons import Daemon, free_port


@dataclass(frozen=True, slots=True)
class Reply:
    """One streamed request as the client saw it."""

    sent_at: float
    first_token_at: float | None
    done_at: float
    prompt_tokens: int | None
    completion_tokens: int
    text: str

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


@dataclass(frozen=True, slots=True)
class Summary:
    """A scenario's figures over all its replies."""

    requests: int
    decode_tok_s: float | None
    ttft_median_s: float | None
    ttft_max_s: float | None
    wall_s: float
    completion_tokens: int


def decoding_s(replies: list[Reply]) -> float:
    """Seconds in which at least one reply was decoding: the union of the replies' spans from
    first token to last. An agent's own prefills and round trips between its turns fall
    outside unless another reply was decoding then."""
    spans = sorted((r.first_token_at, r.done_at) for r in replies if r.first_token_at is not None)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(replies: list[Reply], wall_s: float) -> Summary:
    """Aggregate decode rate: every token after a reply's first, over the seconds in which
    any reply was decoding (`decoding_s`)."""
    ttfts = [r.ttft_s for r in replies if r.ttft_s is not None]
    decoded = sum(max(0, r.completion_tokens - 1) for r in replies)
    span = decoding_s(replies)
    return Summary(len(replies), decoded / span if span > 0 else None,
                   statistics.median(ttfts) if ttfts else None, max(ttfts) if ttfts else None,
                   wall_s, sum(r.completion_tokens for r in replies))


def stream(client, messages: list[dict], max_tokens: int) -> Reply:
    sent = time.perf_counter()
    first, parts, usage = None, [], None
    with client.chat.completions.with_streaming_response.create(
            model="default", messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}) as response:
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    done = time.perf_counter()
    return Reply(sent, first, done, usage.prompt_tokens if usage else None,
                 usage.completion_tokens if usage else len(parts), "".join(parts))


def agent(client, index: int, turns: int, reply_tokens: int, tool_output: str = TOOL_OUTPUT) -> list[Reply]:
    """One rewriting agent's turns, one after another."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Agent {index}, step {turn}. Tool result:\n{tool_output}\n"
                                                    "Explain in detail what to change next and why."})
        reply = stream(client, messages, reply_tokens)
        out.append(reply)
        messages.append({"role": "assistant", "content": reply.text[: len(reply.text) // 2]})
    return out


def agents_at_once(client, count: int, turns: int, reply_tokens: int, tool_output: str = TOOL_OUTPUT) -> Summary:
    started = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        runs = list(pool.map(lambda i: agent(client, i, turns, reply_tokens, tool_output), range(count)))
    return summarize([reply for run in runs for reply in run], time.perf_counter() - started)


def prime_listing(lines: int) -> str:
    return "The repository:\n" + "\n".join(
        f"src/module_{i:03d}.py: defines helper_{i}(x) and class Widget{i}; see tests/test_{i:03d}.py"
        for i in range(lines))


def side_query_during_prime(client, lines: int, delay_s: float) -> tuple[Reply, Reply]:
    """(the prime, the side query sent `delay_s` after it)."""
    prime_messages = [{"role": "system", "content": SYSTEM + "\n" + prime_listing(lines)},
                      {"role": "user", "content": "Which module defines helper_7?"}]
    side_messages = [{"role": "user", "content": "Write a five-word title for: fixing a flaky test."}]
    with ThreadPoolExecutor(2) as pool:
        prime = pool.submit(stream, client, prime_messages, 8)
        time.sleep(delay_s)
        side = pool.submit(stream, client, side_messages, 12)
        return prime.result(), side.result()


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class LlamaServer:
    """llama.cpp's server with -np slots on the GGUF, on a free port (the peer)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, slot_context: int,
                 extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(slots * slot_context),
             "--port", str(self.port), "--host", "127.0.0.1", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not answer /health within 120 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run_server(name: str, url: str, args: argparse.Namespace, rows: list[tuple], side_rows: list[tuple]) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    stream(client, [{"role": "user", "content": "Say hi."}], 4)  # warm: the first request's one-offs
    for reply_tokens in args.replies:
        for count in args.agents:
            result = agents_at_once(client, count, args.turns, reply_tokens)
            rows.append((name, count, reply_tokens, result))
            print(f"{name}: {count} agents x {args.turns} turns, replies of {reply_tokens}: "
                  f"{_s(result.decode_tok_s)} tok/s, TTFT median {_s(result.ttft_median_s)} s, "
                  f"max {_s(result.ttft_max_s)} s, wall {result.wall_s:.1f} s", flush=True)
    if args.prime_lines:
        prime, side = side_query_during_prime(client, args.prime_lines, args.side_delay_s)
        side_rows.append((name, prime, side))
        print(f"{name}: side query TTFT {_s(side.ttft_s)} s during a {prime.prompt_tokens}-token cold prime "
              f"(prime TTFT {_s(prime.ttft_s)} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench concurrent", description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="*", default=[1, 2, 4], help="none: only the side query")
    parser.add_argument("--replies", type=int, nargs="+", default=[48, 400], help="max_tokens per reply")
    parser.add_argument("--turns", type=int, default=3, help="turns per agent")
    parser.add_argument("--prime-lines", type=int, default=440, help="lines of the cold prime (0: skip it)")
    parser.add_argument("--side-delay-s", type=float, default=1.0, help="when the side query follows the prime")
    parser.add_argument("--max-batch", type=int, nargs="*", default=[4], help="one memrad arm per value (none: no memrad arm)")
    parser.add_argument("--batch-decode", nargs="+", default=["batched"], choices=("batched", "rows"),
                        help="engine.batch_decode: one memrad arm per value (for max_batch > 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", default="auto", choices=("auto", "wait", "on", "off"))
    parser.add_argument("--url", help="measure this running server instead of starting memrad arms")
    parser.add_argument("--peer", type=Path, help="llama.cpp's llama-server (also run with -np 4)")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama-server runs (llama-peer.sh prints it)")
    # llama-server caps a slot at the GGUF's trained context (8,192 for the default model); memra
    # serves 32k with YaRN x4, and the 16k prime needs the same: "--rope-scaling yarn
    # --rope-scale 4 --yarn-orig-ctx 8192".
    parser.add_argument("--peer-args", default="", help="more llama-server flags, one string")
    args = parser.parse_args(argv)
    if args.peer is not None and args.gguf is None:
        raise SystemExit("--peer needs --gguf: the GGUF llama-server should run")
    rows: list[tuple] = []
    side_rows: list[tuple] = []
    arms: list[tuple[str, Callable[[], tuple[str, Callable[[], None]]]]] = []
    if args.url:
        arms.append((args.url, lambda: (args.url, lambda: None)))
    else:
        for max_batch in args.max_batch:
            for how in args.batch_decode if max_batch > 1 else ["batched"]:
                def start(max_batch=max_batch, how=how):
                    daemon = Daemon.create({"MEMRA_BATCH_DECODE": how})
                    daemon.start("--threads", str(args.threads), "--max-batch", str(max_batch),
                                 "--compile", args.compile)
                    return daemon.url, daemon.stop
                arms.append((f"memrad max_batch={max_batch}" + (f" {how}" if max_batch > 1 else ""), start))
    if args.peer is not None:
        def peer():
            server = LlamaServer(args.peer, args.gguf, args.threads, 4, 18432, args.peer_args.split())
            return server.url, server.stop
        arms.append(("llama-server -np 4", peer))
    for name, start in arms:
        url, stop = start()
        try:
            run_server(name, url, args, rows, side_rows)
        except Exception as exc:  # one server's failure (a refused request) leaves the others' tables
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            stop()
    print(f"\nturns per agent {args.turns}, threads {args.threads}, temperature 0\n")
    print("| server | agents | reply max_tokens | tokens sent | decode tok/s | TTFT median s | TTFT max s | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, count, reply_tokens, s in rows:
        print(f"| {name} | {count} | {reply_tokens} | {s.completion_tokens} | {_s(s.decode_tok_s)} | "
              f"{_s(s.ttft_median_s)} | {_s(s.ttft_max_s)} | {s.wall_s:.1f} |")
    if side_rows:
        print("\n| server | prime tokens | prime TTFT s | side query TTFT s |")
        print("| --- | ---: | ---: | ---: |")
        for name, prime, side in side_rows:
            print(f"| {name} | {prime.prompt_tokens} | {_s(prime.ttft_s)} | {_s(side.ttft_s)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
