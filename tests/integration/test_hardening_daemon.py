"""The real daemon on the default model: /metrics after real requests, rebinding and
cross-origin refusals, the published OpenAPI document."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from memrad.server.metrics import parse_samples
from memrad.server.openapi import ROUTES

pytestmark = pytest.mark.integration


def raw_post(daemon, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(daemon.url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def scrape(daemon) -> dict:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as response:
        return parse_samples(response.read().decode())


def test_metrics_count_what_real_requests_did(daemon):
    before = scrape(daemon)
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "temperature": 0,
            "session_id": "metrics"}
    status, first = daemon.post("/v1/chat/completions", body)
    assert status == 200
    body["messages"] += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Another."}]
    status, second = daemon.post("/v1/chat/completions", body)
    assert status == 200 and second["memra"]["decision"].startswith(("token-prefix: resumed", "affinity: resumed"))
    after = scrape(daemon)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    route = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert grew("memra_http_requests_total", *route) == 2
    usages = [first["usage"], second["usage"]]
    assert grew("memra_tokens_total", ("kind", "prompt")) == sum(u["prompt_tokens"] for u in usages)
    assert grew("memra_tokens_total", ("kind", "completion")) == sum(u["completion_tokens"] for u in usages)
    assert grew("memra_tokens_total", ("kind", "cached")) == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert grew("memra_ttft_seconds_count") == 2 and grew("memra_decode_tokens_per_second_count") == 2
    assert after[("memra_pool_bytes", (("tier", "memory"),))] == after[("memra_pool_bytes_ledger", ())] > 0
    assert after[("memra_pool_bytes", (("tier", "memory"),))] <= after[("memra_pool_max_bytes", ())]
    assert after[("process_resident_memory_bytes", ())] > 100 * 2**20


def test_rebinding_and_cross_origin_posts_are_refused_by_the_daemon(daemon):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    status, error = raw_post(daemon, "/v1/chat/completions", body, {"Host": "evil.example"})
    assert status == 403 and error["error"]["code"] == "host_not_allowed"
    status, error = raw_post(daemon, "/v1/chat/completions", body,
                             {"Content-Type": "text/plain", "Origin": "https://evil.example"})
    assert status == 403 and error["error"]["code"] == "origin_not_allowed"


def test_the_daemon_publishes_its_routes_as_openapi(daemon):
    document = daemon.get_json("/openapi.json")
    assert document["openapi"].startswith("3.1")
    assert {(m.upper(), p) for p, ops in document["paths"].items() for m in ops} == \
        {(r.method, r.path) for r in ROUTES}
