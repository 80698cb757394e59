"""The real daemon's control socket: where it is, who may open it, what it says."""

from __future__ import annotations

import json
import os
import socket
import stat

import openai
import pytest

from daemon_harness import MODEL_ID
from memrad.protocol import DecisionEvent, ParkEvent, StateSnapshot, TurnEvent, from_line

pytestmark = pytest.mark.integration


def test_status_names_an_owner_only_socket_that_answers_snapshots(daemon):
    report = json.loads(daemon.cli("status", "--json").stdout)
    path = report["socket"]
    assert path == str(daemon.runtime_dir / "memrad.sock")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b'{"op": "snapshot"}\n')
        snapshot = from_line(sock.makefile("rb").readline())
    assert isinstance(snapshot, StateSnapshot)
    assert snapshot.model == MODEL_ID and dict(snapshot.flags)["reuse.mode"] == "exact"
    assert snapshot.pool is not None and snapshot.pool.max_sessions == 32


def test_a_subscriber_sees_the_decision_the_turn_and_the_park(daemon):
    path = json.loads(daemon.cli("status", "--json").stdout)["socket"]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(b'{"op": "subscribe"}\n')
        stream = sock.makefile("rb")
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Say hi."}],
                                               extra_body={"session_id": "watched"})
        events = {}
        while set(events) != {"DecisionEvent", "TurnEvent", "ParkEvent"}:
            event = from_line(stream.readline())
            if getattr(event, "request_id", None) == reply.id or getattr(
                    getattr(event, "decision", None), "request_id", None) == reply.id or isinstance(event, ParkEvent):
                events[type(event).__name__] = event
    decision, turn, park = events["DecisionEvent"], events["TurnEvent"], events["ParkEvent"]
    assert isinstance(decision, DecisionEvent) and decision.identity == "watched"
    assert decision.decision.render() == "cold (nothing parked for this model and cache_salt)"
    assert [s.label for s in decision.segments] == ["system", "user", "assistant"]
    assert isinstance(turn, TurnEvent) and turn.prompt_tokens == reply.usage.prompt_tokens
    assert turn.conversation == park.session.session_id and park.session.identity == "watched"
    assert park.session.prompt_checkpoint == reply.usage.prompt_tokens


def test_memra_tui_draws_the_live_daemon(daemon, tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    path = json.loads(daemon.cli("status", "--json").stdout)["socket"]
    script = Path(sys.executable).parent / "memra-tui"
    exe = str(script) if script.exists() else shutil.which("memra-tui")
    out = tmp_path / "screen.svg"
    result = subprocess.run([exe, "--socket", path, "--screenshot", str(out), "--after", "3"],
                            capture_output=True, text=True, timeout=60, env=daemon.env)
    assert result.returncode == 0, result.stderr
    svg = out.read_text()
    assert "connected&#160;to" in svg and "parked&#160;sessions" in svg
    assert "watched&#160;(session_id)" in svg  # the session parked by the previous test
