"""The disk tier on tiny dense and hybrid models: spill, index, load, and what is refused."""

import dataclasses
import functools

import pytest
import torch

from memrad.engine.state.disk import DiskTier, state_format
import stories

CHUNK = 16
SYSTEM = "You are a helpful coding assistant. Read the file, then answer. " * 3


def make_engine(loaded, kind, directory, max_sessions=8, disk_bytes=10**9):
    """A fresh engine (a restarted daemon) whose disk tier indexes `directory`, told the ropes the
    model runs as memrad.engine.build tells it (gpt-oss ships YaRN as its native rope)."""
    disk = DiskTier(directory, disk_bytes, state_format(loaded[kind], CHUNK, "exact"), loaded[kind].rope_keys)
    return stories.make_engine(loaded[kind], CHUNK, max_sessions=max_sessions, disk=disk, mode="exact")


ask = functools.partial(stories.ask, max_tokens=5)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gemma4", "qwen3_next", "falcon_h1", "lfm2", "gpt_oss"])
def test_a_restart_resumes_from_disk_bit_identically(loaded, kind, tmp_path):
    before = make_engine(loaded, kind, tmp_path)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"}]
    one, _ = ask(before, first, "t1")
    before.close()
    assert [p.name for p in tmp_path.iterdir()] == ["s1.safetensors"]
    after = make_engine(loaded, kind, tmp_path)  # memrad start: index, load nothing
    assert [s.session_id for s in after.parking.disk.pool.sessions()] == ["s1"] and not after.parking.pool.sessions()
    second = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "open README.md"}]
    (warm, warm_state), (cold, cold_state) = ask(after, second, "t2"), ask(after, second, "t2", salt="cold")
    assert warm.decision.outcome == "resumed" and warm.decision.candidate == "s1"
    assert warm.cached_tokens == one.prompt_tokens
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold.text
    # it continued the conversation: the file is replaced by the successor (in memory)
    assert not (tmp_path / "s1.safetensors").exists()
    assert warm_state.session.session_id not in {"s1"} and warm_state.session.session_id != cold_state.session.session_id


def test_eviction_spills_to_disk_and_both_caps_hold_under_a_64_conversation_churn(loaded, tmp_path):
    engine = make_engine(loaded, "llama", tmp_path, max_sessions=2, disk_bytes=250_000)
    for i in range(64):
        ask(engine, [{"role": "user", "content": f"conversation {i}: " + "list files " * 8}], f"c{i}", salt=str(i))
        assert engine.parking.disk.drain() == []  # spills run on the tier's writer thread
        assert len(engine.parking.pool.sessions()) <= 2 and engine.parking.disk.pool.bytes_parked <= 250_000
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
        assert on_disk == engine.parking.disk.pool.bytes_parked
    assert engine.parking.disk.pool.sessions(), "evicted sessions were spilled"


def test_a_foreign_file_is_kept_and_a_truncated_or_garbled_one_set_aside(loaded, tmp_path, caplog):
    before = make_engine(loaded, "llama", tmp_path)
    ask(before, [{"role": "user", "content": "one " * 20}], "a")
    ask(before, [{"role": "user", "content": "two " * 20}], "b", salt="x")
    before.close()
    s1, s2 = tmp_path / "s1.safetensors", tmp_path / "s2.safetensors"
    s2.write_bytes(s2.read_bytes()[:-100])  # a crash mid-copy, or a disk error
    (tmp_path / "s9.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "s3.safetensors.123.tmp").write_bytes(b"half written")
    caplog.set_level("INFO", logger="memrad.disk")
    # s1 was made under another dtype
    other = dict(state_format(loaded["llama"], CHUNK, "exact"), dtype="bfloat16")
    tier = DiskTier(tmp_path, 10**9, other)
    assert tier.index() == []
    # s1 kept, not loaded; s2 and s9 set aside for whoever looks into them (issue 35, item 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1.safetensors", "s2.safetensors.bad", "s9.safetensors.bad"]
    assert list(tier.foreign) == ["s1"] and tier.bytes_used == s1.stat().st_size
    assert tier.session_ids() == ["s1", "s2", "s9"]  # a set-aside file still claims its id
    assert f"set aside s2.safetensors in {tmp_path} as s2.safetensors.bad: truncated (" in caplog.text
    assert f"set aside s9.safetensors in {tmp_path} as s9.safetensors.bad: truncated or not safetensors" in caplog.text
    assert "deleted s3.safetensors.123.tmp: a spill that did not finish" in caplog.text
    assert "kept 1 sessions of other models or settings (tiny-llama" in caplog.text


def test_a_corrupt_file_fails_its_checksum_on_load_and_the_request_runs_cold(loaded, tmp_path, caplog):
    before = make_engine(loaded, "llama", tmp_path)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"}]
    one, _ = ask(before, first, "t1")
    before.close()
    path = tmp_path / "s1.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one flipped bit in the last tensor's bytes
    path.write_bytes(bytes(data))
    after = make_engine(loaded, "llama", tmp_path)
    caplog.set_level("INFO", logger="memrad.disk")
    second = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "more"}]
    done, _ = ask(after, second, "t2")
    assert done.decision.outcome == "cold" and done.cached_tokens == 0
    assert f"set aside s1.safetensors in {tmp_path} as s1.safetensors.bad: checksum mismatch" in caplog.text
    assert not path.exists() and (tmp_path / "s1.safetensors.bad").exists()


def test_a_fork_from_disk_leaves_the_file_in_place(loaded, tmp_path):
    before = make_engine(loaded, "llama", tmp_path)
    ask(before, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A: list files"}], "a")
    before.close()
    after = make_engine(loaded, "llama", tmp_path)
    done, state = ask(after, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "B: run tests"}], "b")
    assert done.decision.tier == "prefix" and done.decision.render().endswith("; forked)")
    assert (tmp_path / "s1.safetensors").exists() and state.session.session_id == "s2"
    assert dataclasses.replace(after.parking.disk.pool.get("s1"), last_used_at=0.0).on_disk


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gemma4", "qwen3_next", "falcon_h1", "lfm2", "gpt_oss"])
def test_every_cache_layer_kind_spills_at_stop_and_reloads_bit_exact(loaded, kind, tmp_path):
    """Dense (SlabLayer), sliding window (DynamicSlidingWindowLayer: a 0-dim int64 window
    tensor), hybrid (linear-attention conv/recurrent dicts; Mamba-2 beside attention; LFM2's
    conv state alone, its recurrent entry None; Gemma 4's KV-shared layers, SharedLayer: no rows), with the
    boundary snapshots a second turn keeps."""
    engine = make_engine(loaded, kind, tmp_path)
    client = stories.Client(engine, SYSTEM)
    client.say("list files")
    client.say("open README.md and summarise it")
    parked = engine.parking.pool.sessions()
    assert parked and (kind == "llama" or any(s.state.snapshots for s in parked))
    assert engine.parking.spill_all() == []  # nothing left unsaved
    after = make_engine(loaded, kind, tmp_path)
    assert sorted(s.session_id for s in after.parking.disk.pool.sessions()) == sorted(s.session_id for s in parked)
    for session in parked:
        state = after.parking.disk.load(after.parking.disk.pool.get(session.session_id), after.new_cache)
        assert state is not None, session.session_id
        stories.assert_same_state(state, session.state)



def test_a_spilled_session_file_is_the_owners_only(loaded, tmp_path):
    # Parked state holds the prompt's tokens: its file is 0600 whatever the umask.
    import os
    import stat

    old = os.umask(0o022)
    try:
        engine = make_engine(loaded, "llama", tmp_path)
        stories.Client(engine, SYSTEM).say("list files")
        assert engine.parking.spill_all() == []
    finally:
        os.umask(old)
    files = list(engine.parking.disk.directory.glob("*.safetensors"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)

class _Odd:
    """A cache layer holding every tensor form a layer may have."""


def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path):
    from memrad.reuse.pool import Namespace, ParkedSession
    from memrad.engine.state.snapshot import ParkedState, Snapshot

    layer = _Odd()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    layer.zero_dim = torch.tensor(7, dtype=torch.int64)
    layer.empty = torch.empty(0, 3, dtype=torch.float16)
    layer.bf16 = torch.randn(3, 5).to(torch.bfloat16)
    layer.flags = torch.tensor([True, False, True])
    layer.strided = base.t()  # not contiguous
    layer.view_a, layer.view_b = base[:2], base[1:]  # two views of one storage
    layer.states = {0: torch.tensor(1.5, dtype=torch.float64), 1: None}
    layer.ready, layer.width = True, 3
    session = ParkedSession("s1", Namespace("m", None), None, (1, 2, 3), "abc", 3, (3,), False, 3, (), 0,
                            1.0, 1.0, state=ParkedState(Snapshot(3, (layer,)), {}, False))
    compat = {"model": "m", "device": "cpu"}
    assert DiskTier(tmp_path, 10**9, compat).spill(session, lambda _: None) is None
    tier = DiskTier(tmp_path, 10**9, compat)
    tier.index()
    state = tier.load(tier.pool.get("s1"), lambda: type("Cache", (), {"layers": [_Odd()]})())
    stories.assert_same_state(state, session.state)


def test_a_spill_that_fails_at_eviction_is_logged_and_counted_and_at_stop_reported(loaded, tmp_path, caplog):
    from memrad.protocol import EvictEvent
    from memrad.server.metrics import Metrics, parse_samples

    engine = make_engine(loaded, "llama", tmp_path, max_sessions=1)
    metrics, events = Metrics(), []
    engine.events.subscribe(metrics.observe)
    engine.events.subscribe(events.append)

    def broken(session):
        raise RuntimeError("no file form for this state")

    engine.parking.disk._encode = broken
    caplog.set_level("INFO", logger="memrad")
    ask(engine, [{"role": "user", "content": "one " * 20}], "a")
    ask(engine, [{"role": "user", "content": "two " * 20}], "b", salt="x")  # evicts s1: its spill fails
    assert [(s.session_id, why) for s, why in engine.parking.disk.drain()] == [
        ("s1", "RuntimeError: no file form for this state")]
    evicted = [e for e in events if isinstance(e, EvictEvent)]
    assert [(e.session_id, e.spill_failed) for e in evicted] == [("s1", "RuntimeError: no file form for this state")]
    assert "could not write s1 to the disk tier (RuntimeError: no file form for this state)" in caplog.text
    assert parse_samples(metrics.exposition().decode())[("memra_spill_failures_total", ())] == 1
    assert engine.close() == ["s2 (75 tokens): RuntimeError: no file form for this state"]
    assert list(tmp_path.iterdir()) == []


def test_switching_models_back_and_forth_keeps_both_models_sessions(loaded, tmp_path):
    """One disk tier, two models: each start loads its own files and keeps the other's."""
    dense = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"}]
    windowed = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "run the tests"}]
    a = make_engine(loaded, "llama", tmp_path)
    a_one, _ = ask(a, dense, "a1")
    a.close()
    b = make_engine(loaded, "gemma3", tmp_path)
    assert b.parking.disk.pool.sessions() == [] and list(b.parking.disk.foreign) == ["s1"]
    b_one, _ = ask(b, windowed, "b1")
    b.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1.safetensors", "s2.safetensors"]
    a = make_engine(loaded, "llama", tmp_path)  # back to the first model: its session resumes
    assert [s.session_id for s in a.parking.disk.pool.sessions()] == ["s1"] and list(a.parking.disk.foreign) == ["s2"]
    done, state = ask(a, dense + [{"role": "assistant", "content": a_one.text}, {"role": "user", "content": "more"}], "a2")
    assert done.decision.outcome == "resumed" and done.decision.candidate == "s1"
    assert done.cached_tokens == a_one.prompt_tokens
    a.close()
    b = make_engine(loaded, "gemma3", tmp_path)  # and to the second: its session is still there
    done, _ = ask(b, windowed + [{"role": "assistant", "content": b_one.text}, {"role": "user", "content": "more"}], "b2")
    assert done.decision.outcome == "resumed" and done.decision.candidate == "s2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{state.session.session_id}.safetensors"]
    b.close()  # b's successor is written beside a's
    assert len(list(tmp_path.iterdir())) == 2


def test_one_byte_cap_with_lru_across_models(loaded, tmp_path, caplog):
    caplog.set_level("INFO", logger="memrad.disk")
    b = make_engine(loaded, "gemma3", tmp_path)
    ask(b, [{"role": "user", "content": "the oldest, of another model " * 3}], "b1")
    b.close()
    a = make_engine(loaded, "llama", tmp_path)
    ask(a, [{"role": "user", "content": "newer " * 12}], "a1")
    a.close()
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert sorted(sizes) == ["s1.safetensors", "s2.safetensors"]
    s1, s2 = sizes["s1.safetensors"], sizes["s2.safetensors"]
    cap = 2 * s2 + s1 // 2  # room for s1 and s2, or for s2 and one as large as s2: not for all three
    assert s1 + s2 <= cap < s1 + 2 * s2
    a = make_engine(loaded, "llama", tmp_path, disk_bytes=cap)
    assert a.parking.disk.bytes_used == sum(sizes.values())
    ask(a, [{"role": "user", "content": "newer " * 12}], "a2", salt="x")  # as large as s2, another namespace
    a.close()
    # the least recently used file goes, whichever model made it: the other model's s1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2.safetensors", "s3.safetensors"]
    assert "deleted s1.safetensors: least recently used (a tiny-gemma3" in caplog.text
    assert a.parking.disk.bytes_used <= cap


def test_memrad_cache_clear_and_status_per_model(loaded, tmp_path, monkeypatch, capsys):
    import json

    from memrad import cli

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    sessions = tmp_path / "sessions"
    monkeypatch.setenv("MEMRA_DISK_DIR", str(sessions))
    for kind, salts in (("llama", ["1", "2"]), ("gemma3", ["3"])):
        engine = make_engine(loaded, kind, sessions)
        for salt in salts:
            ask(engine, [{"role": "user", "content": f"conversation {salt}"}], salt, salt=salt)
        engine.close()
    (sessions / "notes.txt").write_text("not memra's")
    sizes = {p.name: p.stat().st_size for p in sessions.glob("*.safetensors")}
    llama, gemma = loaded["llama"].model_id, loaded["gemma3"].model_id
    assert cli.main(["status", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["disk"]["models"] == {
        gemma: {"sessions": 1, "bytes": sizes["s3.safetensors"]},
        llama: {"sessions": 2, "bytes": sizes["s1.safetensors"] + sizes["s2.safetensors"]}}
    assert cli.main(["cache", "clear", "--model", gemma]) == 0
    assert "deleted 1 parked sessions" in capsys.readouterr().out
    assert sorted(p.name for p in sessions.iterdir()) == ["notes.txt", "s1.safetensors", "s2.safetensors"]
    assert cli.main(["cache", "clear", "--model", "no-such-model"]) == 0
    assert f"no parked sessions of no-such-model in {sessions} (on disk: {llama})" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert sorted(p.name for p in sessions.iterdir()) == ["notes.txt"]  # what is not memra's stays


def test_an_eviction_spill_runs_off_the_engine_thread(loaded, tmp_path):
    import threading
    import time

    engine = make_engine(loaded, "llama", tmp_path, max_sessions=1)
    disk, release, writers = engine.parking.disk, threading.Event(), []
    encode = disk._encode

    def slow(session):  # a write that takes as long as the test wants
        writers.append(threading.current_thread().name)
        release.wait(10)
        return encode(session)

    disk._encode = slow
    ask(engine, [{"role": "user", "content": "one " * 20}], "a")
    started = time.perf_counter()
    ask(engine, [{"role": "user", "content": "two " * 20}], "b", salt="x")  # evicts s1
    assert time.perf_counter() - started < 5  # the request did not wait for the write
    assert disk.pool.sessions() == [] and not (tmp_path / "s1.safetensors").exists()  # not visible half-written
    release.set()
    assert disk.drain() == []
    assert writers and writers[0].startswith("memrad-spill")
    assert [s.session_id for s in disk.pool.sessions()] == ["s1"] and (tmp_path / "s1.safetensors").exists()


def test_the_spill_ttft_bench_measures_both_arms(loaded):
    from memrad.bench.spill_ttft import run

    for sync in (True, False):
        b_ttft, b_tail, c_ttft, gap, prompt_tokens = run(loaded["llama"], 1, sync, 0, lines=6)
        assert prompt_tokens > 100 and 0 < b_ttft and 0 <= b_tail < gap and 0 < c_ttft <= gap
