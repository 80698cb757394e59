"""The disk tier through the real daemon: parked state survives `memrad stop && memrad start`
and a `kill -9` (what was spilled before it), and the next turn resumes from disk."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from daemon_harness import wait_until
from test_reuse_default_model import FIRST_USER, SYSTEM, second_turn

pytestmark = pytest.mark.integration


def chat(daemon, messages):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=12)


def started(daemon):
    result = daemon.start()
    assert result.returncode == 0, result.stderr
    return daemon


def test_stop_then_start_resumes_the_next_turn_from_disk(make_daemon):
    daemon = started(make_daemon())
    first = chat(daemon, [SYSTEM, FIRST_USER])
    assert daemon.cli("stop").returncode == 0
    assert [p.name for p in daemon.sessions_dir.glob("*.safetensors")] == ["s1.safetensors"]
    assert "wrote 1 of 1 parked sessions to" in daemon.log_text()
    started(daemon)
    assert "disk tier: 1 parked sessions" in daemon.log_text()
    second = chat(daemon, second_turn(first.choices[0].message.content))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    log = daemon.log_text()
    assert "loaded s1 from disk" in log
    assert f"{second.id} token-prefix: resumed (session s1;" in log or f"{second.id} text-prefix: resumed (session s1;" in log
    assert not (daemon.sessions_dir / "s1.safetensors").exists()  # replaced by its successor


def test_after_kill_9_what_was_spilled_resumes(make_daemon):
    daemon = make_daemon()
    daemon.env["MEMRA_POOL_MAX_SESSIONS"] = "1"
    started(daemon)
    first = chat(daemon, [SYSTEM, FIRST_USER])
    chat(daemon, [{"role": "user", "content": "An unrelated question: what is 2 + 2?"}])  # evicts s1: spilled
    assert (daemon.sessions_dir / "s1.safetensors").exists()
    pid = daemon.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: daemon.status().get("running") is False, 20.0)
    started(daemon)
    second = chat(daemon, second_turn(first.choices[0].message.content))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert "loaded s1 from disk" in daemon.log_text()
