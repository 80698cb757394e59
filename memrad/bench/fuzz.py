"""Property-based fuzzing of a running memrad: `memrad bench fuzz` (needs hypothesis).

Hypothesis generates malformed and boundary requests for every route in
memrad.server.openapi.ROUTES (the routes /openapi.json publishes): bodies that follow each
field's type and range at its edges, bodies of arbitrary JSON, broken bytes, odd methods,
paths and headers. Every answer must be below 500, arrive within a deadline and, when it is
an error, carry an error body. Every `canary_every` requests a canary conversation runs
its second turn again: it must resume from its parked state and answer exactly what a cold
run answered before the fuzzing started (greedy; exact mode makes resumed equal cold).
At the end the daemon must still answer /health and a well-formed request.

The same `fuzz` function drives the fast slice in the unit tests (a tiny model in-process)
and the long run against the default model (`memrad bench fuzz --requests 5000`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed

from memrad.server.openapi import ROUTES, Route

DEADLINE_S = 120.0      # a request slower than this counts as a hang
GENERATE_TOKENS = 3     # valid generating requests are clamped to this many tokens
GENERATING = frozenset(r.path for r in ROUTES if r.generates)
STREAM_ENDS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed", b"event: response.incomplete")
CANARY = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]

# --- strategies ----------------------------------------------------------------------------

_edge_ints = st.sampled_from([0, 1, -1, 2, 4, 2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**30])
_edge_floats = st.sampled_from([0.0, -0.0, 1e-300, 2.0000001, -2.0, float("nan"), float("inf"), float("-inf"), 1e308])
_text = st.text(max_size=24) | st.sampled_from(["", " ", "\x00", "<|im_start|>", "<|im_end|>", "\ud800",
                                                "x" * 300, "default", "\u202e", "\r\n\r\n"])
_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _edge_ints | st.floats() | _edge_floats | _text
_json = st.recursive(_scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
                     max_leaves=10)
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", ""]) | _json,
                               "text": _text | _json})
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", ""]) | _json},
    optional={"content": _text | st.lists(_part, max_size=3) | _json, "name": _text | _json,
              "tool_call_id": _text | _json, "tool_calls": st.lists(_json, max_size=2) | _json})
_FIELDS = {
    "messages": st.lists(_message, max_size=4) | _json,
    "prompt": _text | st.lists(st.integers(-3, 60_000) | _edge_ints, max_size=8) | st.lists(_text, max_size=2) | _json,
    "model": st.sampled_from(["default", "gpt-4o", "", "SmolLM2-135M-Instruct"]) | _json,
    "max_tokens": st.integers(-2, 8) | _edge_ints | _json,
    "max_completion_tokens": st.integers(-2, 8) | _edge_ints | _json,
    "temperature": st.floats(-1, 3) | _edge_floats | _json,
    "top_p": st.floats(-1, 2) | _edge_floats | _json,
    "seed": st.integers(-(2**70), 2**70) | _edge_ints | _json,
    "stop": _text | st.lists(_text, max_size=6) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "n": _edge_ints | _json,
    "logprobs": st.booleans() | _json,
    "top_logprobs": _edge_ints | _json,
    "tools": st.lists(_json, max_size=3) | _json,
    "session_id": _text | _json,
    "user": _text | _json,
    "cache_salt": _text | _json,
    "response_format": st.just({"type": "text"}) | _json,
    "input": _text | st.lists(_message | st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
        optional={"role": _text, "content": _text | st.lists(_part, max_size=2), "call_id": _text,
                  "name": _text, "arguments": _text | _json, "output": _text | _json}), max_size=4) | _json,
    "instructions": _text | _json,
    "max_output_tokens": st.integers(-2, 8) | _edge_ints | _json,
    "previous_response_id": _text | _json,
    "store": st.booleans() | _json,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}, {"type": "any"},
                                    {"type": "tool", "name": "f"}]) | _json,
    "parallel_tool_calls": st.booleans() | _json,
    "system": _text | st.lists(_part, max_size=2) | _json,
    "stop_sequences": st.lists(_text, max_size=6) | _json,
    "metadata": st.fixed_dictionaries({}, optional={"user_id": _text | _json}) | _json,
}


# Values a real client sends, at their edges: half of the one-field-off bodies use these, so
# a share of the probes passes validation and runs on the model (streams, stops, seeds, tools).
_PLAUSIBLE = {
    "temperature": st.sampled_from([0, 0.0, 2, 1e-9, 1.9999]), "top_p": st.sampled_from([1, 1e-9, 0.5]),
    "seed": st.sampled_from([0, -1, 2**63 - 1, 2**64 - 1, -(2**63)]), "stream": st.booleans(),
    "stop": st.sampled_from(["\n", ["a", "b", "c", "d"], "x" * 256, ["<|im_end|>"]]),
    "stop_sequences": st.sampled_from([["\n"], ["a", "b", "c", "d"], ["x" * 256]]),
    "stream_options": st.just({"include_usage": True}), "n": st.just(1), "logprobs": st.just(False),
    "session_id": st.sampled_from(["a", "x" * 256, "é\r\n", "fuzz"]), "user": st.just("u"),
    "cache_salt": st.sampled_from(["s", "x" * 256]), "max_tokens": st.sampled_from([1, 2]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "metadata": st.sampled_from([{}, {"user_id": "a"}]), "instructions": st.sampled_from(["", "Be brief."]),
}


@st.composite
def _one_field_off(draw, route: Route, known: dict) -> dict:
    """A valid body with one or two fields at an edge: reaches past validation into the engine."""
    body = dict(route.example or {})
    for key in draw(st.lists(st.sampled_from(sorted(known)), min_size=1, max_size=2, unique=True)):
        plausible = _PLAUSIBLE.get(key)
        body[key] = draw(plausible if plausible is not None and draw(st.booleans()) else known[key])
    return body


def _body_for(route: Route) -> st.SearchStrategy[dict]:
    known = {k: _FIELDS[k] for k in (route.body or {}).get("properties", {}) if k in _FIELDS}
    return (st.fixed_dictionaries({}, optional=known) | _one_field_off(route, known)
            | st.dictionaries(_text, _json, max_size=4))


@dataclass(frozen=True, slots=True)
class Probe:
    """One request to send: method, path, headers and raw body bytes."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


def _encode(body: object, route: Route) -> bytes:
    if isinstance(body, dict) and route.generates:
        body = dict(body)
        # No long decodes: valid lengths are clamped (huge ones stay on the OpenAI routes, where
        # they are a 400; Anthropic's /v1/messages lowers them to the context left, so clamp all).
        ceiling = 2**20 if not route.path.startswith("/v1/messages") else None
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if (isinstance(value, int) and not isinstance(value, bool) and value > GENERATE_TOKENS
                    and (ceiling is None or value < ceiling)):
                body[key] = GENERATE_TOKENS
        if not any(body.get(key) is not None for key in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            body["max_output_tokens" if route.path == "/v1/responses" else "max_tokens"] = GENERATE_TOKENS
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


_mangle = st.sampled_from(["none", "truncate", "bytes", "nest", "empty"])
_headers = st.lists(st.sampled_from([("Content-Type", "text/plain"), ("Content-Type", "application/json"),
                                     ("Content-Type", "multipart/form-data"), ("x-session-id", "fuzz"),
                                     ("x-session-id", "\u00e9\u00e9"), ("Accept", "text/event-stream"),
                                     ("Transfer-Encoding", "chunked")]), max_size=2, unique=True)


@st.composite
def probes(draw) -> Probe:
    route = draw(st.sampled_from(ROUTES))
    if route.body is None:
        method = draw(st.sampled_from([route.method] * 4 + ["POST", "DELETE", "PUT"]))
        path = route.path + draw(st.sampled_from(["", "", "?x=1", "/", "?stream=true&%zz"]))
        return Probe(method, path, tuple(draw(_headers)), None)
    raw = _encode(draw(_body_for(route)), route)
    how = draw(_mangle)
    if how == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "bytes":
        raw = draw(st.binary(max_size=64))
    elif how == "nest":
        raw = b"[" * draw(st.integers(1, 5000)) + raw
    elif how == "empty":
        raw = b""
    method = draw(st.sampled_from(["POST"] * 8 + ["GET", "PATCH"]))
    headers = tuple(h for h in draw(_headers) if h[0] != "Transfer-Encoding")
    return Probe(method, route.path, headers, raw)


# --- the run -------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    bad_bodies: list[str] = field(default_factory=list)
    canaries: int = 0
    generated: int = 0  # probes that passed validation and ran on the model
    canary_failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    elapsed_s: float = 0.0
    alive_after: bool = False

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def ok(self) -> bool:
        return (self.alive_after and self.canaries > 0 and not (self.server_errors or self.hangs
                or self.bad_bodies or self.canary_failures))

    def lines(self) -> list[str]:
        by_status = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return [f"requests {self.requests} in {self.elapsed_s:.0f} s ({by_status}; {self.generated} ran on the model)",
                f"server errors (5xx) {len(self.server_errors)}, hangs (> {DEADLINE_S:.0f} s) {len(self.hangs)}, "
                f"error bodies missing {len(self.bad_bodies)}, slowest {self.slowest_s:.2f} s",
                f"canary resumes {self.canaries}, mismatches {len(self.canary_failures)}; "
                f"daemon alive after: {'yes' if self.alive_after else 'NO'}",
                *[f"  {x}" for x in (self.server_errors + self.hangs + self.bad_bodies + self.canary_failures)[:10]]]


class Client:
    """A plain HTTP/1.1 client (http.client): sends exactly the bytes a probe holds."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def send(self, probe: Probe, timeout: float = DEADLINE_S) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(probe.method, probe.path, body=probe.body, headers={**self.auth, **dict(probe.headers)})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def chat(self, messages: list[dict], **fields) -> tuple[int, dict, dict]:
        body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 8, **fields}).encode()
        status, headers, raw = self.send(Probe("POST", "/v1/chat/completions",
                                               (("Content-Type", "application/json"),), body))
        return status, headers, json.loads(raw)


def _check(probe: Probe, status: int, headers: dict, raw: bytes, report: FuzzReport) -> None:
    what = f"{probe.method} {probe.path} {(probe.body or b'')[:120]!r}"
    report.statuses[status] += 1
    report.generated += status == 200 and probe.method == "POST" and probe.path in GENERATING
    if status >= 500:
        report.server_errors.append(f"{status} {what}: {raw[:300]!r}")
    elif status >= 400:
        try:  # the shape of the API called: Anthropic's envelope on /v1/messages*, else OpenAI's
            body = json.loads(raw)
            anthropic = probe.path.startswith("/v1/messages")
            assert body["error"]["message"] and (body.get("type") == "error") == anthropic
        except (ValueError, KeyError, TypeError, AssertionError):
            report.bad_bodies.append(f"{status} without its API's error body: {what}: {raw[:200]!r}")
    elif status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        last_event = raw.rstrip().rsplit(b"\n\n", 1)[-1]
        if not last_event.startswith(STREAM_ENDS):
            report.bad_bodies.append(f"stream without its final event: {what}: {raw[-200:]!r}")


class Canary:
    """A parked conversation that must keep resuming to exactly its cold answer."""

    def __init__(self, client: Client) -> None:
        self.client = client
        status, _, first = client.chat(CANARY, session_id="fuzz-canary")
        assert status == 200, first
        self.turn2 = CANARY + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                               {"role": "user", "content": "Another."}]
        status, _, cold = client.chat(self.turn2, cache_salt="fuzz-cold-reference")
        assert status == 200 and cold["memra"]["decision"].startswith("cold"), cold
        self.expected = cold["choices"][0]["message"]["content"]

    def check(self, report: FuzzReport) -> None:
        status, headers, body = self.client.chat(self.turn2, session_id="fuzz-canary")
        report.canaries += 1
        decision = headers.get("x-memra-decision", "")
        text = body["choices"][0]["message"]["content"] if status == 200 else None
        if status != 200 or "resumed" not in decision or text != self.expected:
            report.canary_failures.append(f"canary {report.canaries}: {status} {decision!r} {text!r} "
                                          f"(cold: {self.expected!r})")


def fuzz(base_url: str, requests: int, seed: int = 0, api_key: str | None = None,
         canary_every: int = 250, progress: bool = False) -> FuzzReport:
    """Send `requests` generated probes (plus canaries) to a running daemon; never raises
    on what the daemon answers: the report holds every failure. `progress` prints the
    figures so far at every canary."""
    client = Client(base_url, api_key)
    report = FuzzReport()
    canary = Canary(client)
    started = time.monotonic()

    @hypothesis_seed(seed)
    @settings(max_examples=requests, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(probes())
    def one(probe: Probe) -> None:
        t0 = time.monotonic()
        try:
            status, headers, raw = client.send(probe)
        except (TimeoutError, OSError) as exc:
            report.hangs.append(f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s: "
                                f"{probe.method} {probe.path} {(probe.body or b'')[:120]!r}")
            return
        report.slowest_s = max(report.slowest_s, time.monotonic() - t0)
        _check(probe, status, headers, raw, report)
        if report.requests % canary_every == 0:
            canary.check(report)
            if progress:
                report.elapsed_s = time.monotonic() - started
                failures = report.server_errors + report.hangs + report.bad_bodies + report.canary_failures
                print(" | ".join(report.lines()[:2]), f"| canaries {report.canaries}", *failures[-3:],
                      sep="\n  " if failures else " ", flush=True)

    one()
    canary.check(report)
    report.elapsed_s = time.monotonic() - started
    try:
        status, _, health = client.send(Probe("GET", "/health", (), None), timeout=30)
        status2, _, answer = client.chat([{"role": "user", "content": "Say hi."}], max_tokens=2)
        report.alive_after = (status, status2) == (200, 200) and answer["usage"]["completion_tokens"] >= 1
    except (OSError, ValueError, KeyError):
        report.alive_after = False
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="fuzz this running daemon instead of a fresh one")
    parser.add_argument("--api-key")
    parser.add_argument("--model", default="default", help="the fresh daemon's --model")
    args = parser.parse_args(argv)
    if args.url:
        report = fuzz(args.url, args.requests, args.seed, args.api_key, progress=True)
    else:
        from memrad.bench.daemons import Daemon

        daemon = Daemon.create()
        daemon.start("--model", args.model)
        try:
            report = fuzz(daemon.url, args.requests, args.seed, progress=True)
        finally:
            daemon.stop()
    for line in report.lines():
        print(line)
    print("PASS" if report.ok else "FAIL")
    return 0 if report.ok else 1
