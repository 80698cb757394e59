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
    # on the disk tier's writer thread, just after the request that evicted it
    assert wait_until(lambda: (daemon.sessions_dir / "s1.safetensors").exists(), 20.0)
    pid = daemon.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: daemon.status().get("running") is False, 20.0)
    started(daemon)
    second = chat(daemon, second_turn(first.choices[0].message.content))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert "loaded s1 from disk" in daemon.log_text()


def test_gemma3_stop_spills_its_sliding_window_state_and_a_restart_resumes_bit_exact(make_daemon):
    """gemma3-270m holds a 0-dim int64 tensor in every sliding-window layer: its stop used to
    crash writing the session (and still said `memrad stopped`, exit 0)."""
    from memrad.engine.model.catalog import GEMMA3_270M
    from memrad.engine.model.pull import is_converted, model_dir

    if not is_converted(model_dir(GEMMA3_270M)):
        pytest.skip("gemma3-270m is not in the cache: run `memrad pull gemma3-270m`")
    daemon = make_daemon()
    daemon.env["MEMRA_MODEL"] = GEMMA3_270M.name
    started(daemon)
    # gemma's template folds a system message into the first user turn
    first = chat(daemon, [FIRST_USER])
    stopped = daemon.cli("stop")
    assert stopped.returncode == 0 and "memrad stopped" in stopped.stdout, stopped.stderr
    assert [p.name for p in daemon.sessions_dir.glob("*.safetensors")] == ["s1.safetensors"]
    assert "wrote 1 of 1 parked sessions to" in daemon.log_text()
    started(daemon)
    turn = [FIRST_USER, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now open README.md and summarise it in one line."}]
    warm = chat(daemon, turn)
    assert "loaded s1 from disk" in daemon.log_text()
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    cold = client.chat.completions.create(model="default", messages=turn, temperature=0, max_tokens=12,
                                          extra_body={"cache_salt": "cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
