"""The reuse pool through the HTTP API: a second turn reports cached tokens; pool off, none."""

from __future__ import annotations

import re

import openai
import pytest

from test_reuse_default_model import FIRST_USER, SYSTEM, exact_resume, second_turn

pytestmark = pytest.mark.integration

CHUNK = 256


def chat(client, messages, **extra):
    return client.chat.completions.create(model="default", messages=messages, temperature=0,
                                          max_tokens=12, **extra)


def client_for(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def test_the_second_turn_resumes_and_reports_cached_tokens(daemon):
    client = client_for(daemon)
    first = chat(client, [SYSTEM, FIRST_USER])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, second_turn(first.choices[0].message.content))
    p1 = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == exact_resume(p1)
    log = daemon.log_text()
    assert f"{second.id} token-prefix: resumed (session" in log or f"{second.id} text-prefix: resumed (session" in log
    assert f"{first.id} cold (nothing parked for this model and cache_salt)" in log
    assert "reuse pool: exact mode, up to 32 sessions" in log


def test_with_the_pool_off_every_turn_runs_cold_and_nothing_breaks(make_daemon):
    daemon = make_daemon()
    daemon.env["MEMRA_REUSE_POOL"] = "0"
    started = daemon.start()
    assert started.returncode == 0, started.stderr
    client = client_for(daemon)
    messages = [SYSTEM, FIRST_USER]
    for turn in range(3):  # turns 2 and 3 would resume (and retire a session) with the pool on
        reply = chat(client, messages)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        messages = second_turn(reply.choices[0].message.content) if turn == 0 else \
            messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": f"And turn {turn + 2}?"}]
    log = daemon.log_text()
    assert "reuse pool disabled: every request runs cold" in log
    assert log.count("cold (reuse pool disabled)") == 3
    assert daemon.cli("stop").returncode == 0


def test_a_rewritten_named_turn_resumes_via_affinity_and_says_so(daemon):
    client = client_for(daemon)
    first = client.chat.completions.with_raw_response.create(
        model="default", messages=[SYSTEM, FIRST_USER], temperature=0, max_tokens=12,
        extra_body={"session_id": "agent-42"})
    # Earlier tests of this module parked the same system prompt under other names: the
    # longest-prefix tier forks it (the reused tokens are this request's own), affinity does not.
    # (Run alone, nothing is parked yet: cold.)
    assert re.fullmatch(r'prefix: resumed \(longest prefix with s\d+, 512 of \d+; forked\)'
                        r'|cold \(nothing parked for this model and cache_salt\)',
                        first.headers["x-memra-decision"]), first.headers["x-memra-decision"]
    reply = first.parse()
    trimmed = reply.choices[0].message.content[:10]  # the client keeps only the start of the reply
    second = client.chat.completions.with_raw_response.create(
        model="default", messages=second_turn(trimmed), temperature=0, max_tokens=12,
        extra_body={"session_id": "agent-42"})
    p1 = reply.usage.prompt_tokens
    decision = second.headers["x-memra-decision"]
    assert decision.startswith('affinity: resumed (explicit, session_id "agent-42", 2 shared segments; '
                               f"checkpoint {exact_resume(p1)}; primed ")
    body = second.parse()
    assert body.usage.prompt_tokens_details.cached_tokens == exact_resume(p1)
    assert body.model_extra["memra"]["decision"] == decision
    assert f"{body.id} {decision}" in daemon.log_text()
