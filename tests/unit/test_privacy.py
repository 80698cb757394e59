"""Log hygiene and privacy: client strings cannot forge log lines or reach a terminal raw,
long ones are cut with their length, and the log, recordings and parked-state folders are
the owner's only (memrad.loglines, memrad.private)."""

from __future__ import annotations

from dataclasses import replace

import argparse
import asyncio
import logging
import os
import stat

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from memrad.config import Settings
from memrad.loglines import RateLimitedLog, SafeFormatter, clean
from memrad.private import open_private, private_dir
from memrad.server.app import make_app

FORGED = "x\nERROR memrad.security: SECURITY: FAKE LINE\x1b[2J\x1b]0;owned\x07"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def daemon_logging(tmp_path, monkeypatch):
    """configure_logging as the daemon runs it, into a temporary state folder; restored after."""
    from memrad import daemon

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield daemon.configure_logging
    for handler in root.handlers:
        handler.close()
    root.handlers[:], root.level = saved


def test_a_forged_line_in_a_client_string_stays_inside_its_record(daemon_logging):
    from memrad.paths import log_path

    daemon_logging("info", detached=True)
    logging.getLogger("memrad.engine").info("%s affinity: declined (named %s)", "chat-1", FORGED)
    try:
        raise ValueError("bad\nERROR memrad: FAKE")
    except ValueError:
        logging.getLogger("memrad.server").exception("internal error on %s", "/v1/x\n")
    text = log_path().read_text()
    lines = text.splitlines()
    assert "\x1b" not in text and "\x07" not in text
    records = [line for line in lines if not line.startswith(" ")]
    assert len(records) == 2, lines
    assert records[0].endswith(r"chat-1 affinity: declined (named x\nERROR memrad.security: SECURITY: FAKE "
                               r"LINE\x1b[2J\x1b]0;owned\x07)")
    assert records[1].endswith(r"internal error on /v1/x\n")
    # A traceback's lines are indented: a forged line in an exception message cannot pose as a record.
    assert lines[-2:] == ["    ValueError: bad", "    ERROR memrad: FAKE"]


def test_the_log_is_private_and_rotated_and_memrad_logs_reads_across_the_rotation(daemon_logging, capsys):
    from memrad.cli import cmd_logs
    from memrad.paths import log_path

    daemon_logging("info", detached=True, max_bytes=2000, backups=2)
    for i in range(60):
        logging.getLogger("memrad").info("line %03d %s", i, "x" * 40)
    path = log_path()
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert path.stat().st_size <= 2000 and mode(path.with_name("memrad.log.1")) == 0o600
    assert not path.with_name("memrad.log.3").exists()  # two backups kept, the rest dropped
    assert cmd_logs(argparse.Namespace(lines=30, follow=False)) == 0
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 30 and shown[-1].split(": ", 1)[1].startswith("line 059")
    assert [int(line.split("line ")[1][:3]) for line in shown] == list(range(30, 60))


def test_an_old_world_readable_log_is_narrowed(tmp_path):
    old = tmp_path / "logs" / "memrad.log"
    old.parent.mkdir()
    old.write_text("prompts\n")
    os.chmod(old, 0o644)
    os.chmod(old.parent, 0o755)
    with open_private(old, "a", tighten_dir=True) as handle:
        handle.write("more\n")
    assert (mode(old), mode(old.parent), old.read_text()) == (0o600, 0o700, "prompts\nmore\n")


def test_a_recording_is_0600_in_a_new_0700_folder_and_a_named_folder_is_left_alone(tmp_path):
    from memrad.server.control import EventBus

    os.chmod(tmp_path, 0o755)
    record = tmp_path / "new" / "deeper" / "turns.jsonl"
    bus = EventBus(asyncio.new_event_loop(), record)
    assert mode(record) == 0o600
    assert mode(record.parent) == 0o700 and mode(record.parent.parent) == 0o700
    assert mode(tmp_path) == 0o755  # the user's own folder is not chmod-ed
    assert private_dir(tmp_path) == tmp_path and mode(tmp_path) == 0o755


def test_clean_escapes_and_cuts():
    assert clean("a\\b\n\x1b\u2028ok") == r"a\\b\n\x1b\u2028ok"
    assert clean("é and 名前") == "é and 名前"
    assert clean("y" * 1000, 10) == "yyyyyyyyyy...(1000 chars)"


def test_repeated_warnings_are_thinned_and_the_next_says_how_many(caplog):
    limited = RateLimitedLog(logging.getLogger("memrad.server"), every_s=0.05)
    with caplog.at_level(logging.INFO):
        assert limited.warning("refused %d", 1) and not limited.warning("refused %d", 2)
        assert not limited.warning("refused %d", 3)
        import time

        time.sleep(0.06)
        assert limited.warning("refused %d", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1", "refused 4 (2 more like this in the last 0.05 s not logged)"]


async def test_a_megabyte_model_name_is_not_echoed_back_whole(fake_engine):
    # Unknown names are served by the loaded model unless server.strict_model_names: the 404 is there.
    settings = Settings()
    settings = replace(settings, server=replace(settings.server, strict_model_names=True))
    server = TestServer(make_app(settings, fake_engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m" * 2**20 + "\n", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(server.make_url("/v1/chat/completions"), json=body) as resp:
                got = await resp.json()
        assert resp.status == 404 and len(got["error"]["message"]) < 500
        assert got["error"]["message"].startswith('the model "' + "m" * 200 + '...(1048577 chars)" does not exist')
    finally:
        await server.close()

