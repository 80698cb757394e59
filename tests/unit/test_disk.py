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
    """A fresh engine (a restarted daemon) whose disk tier indexes `directory`."""
    disk = DiskTier(directory, disk_bytes, state_format(loaded[kind], CHUNK, "exact"))
    return stories.make_engine(loaded[kind], CHUNK, max_sessions=max_sessions, disk=disk, mode="exact")


ask = functools.partial(stories.ask, max_tokens=5)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next", "gemma3"])
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
        assert len(engine.parking.pool.sessions()) <= 2 and engine.parking.disk.pool.bytes_parked <= 250_000
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
        assert on_disk == engine.parking.disk.pool.bytes_parked
    assert engine.parking.disk.pool.sessions(), "evicted sessions were spilled"


def test_a_foreign_or_truncated_file_is_skipped_and_deleted(loaded, tmp_path, caplog):
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
    assert DiskTier(tmp_path, 10**9, other).index() == []
    assert list(tmp_path.iterdir()) == []
    assert "deleted s1.safetensors: made under" in caplog.text
    assert "deleted s2.safetensors: unreadable" in caplog.text


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
    assert "deleted s1.safetensors: skipped (Unusable: checksum mismatch)" in caplog.text
    assert not path.exists()


def test_a_fork_from_disk_leaves_the_file_in_place(loaded, tmp_path):
    before = make_engine(loaded, "llama", tmp_path)
    ask(before, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A: list files"}], "a")
    before.close()
    after = make_engine(loaded, "llama", tmp_path)
    done, state = ask(after, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "B: run tests"}], "b")
    assert done.decision.tier == "prefix" and done.decision.render().endswith("; forked)")
    assert (tmp_path / "s1.safetensors").exists() and state.session.session_id == "s2"
    assert dataclasses.replace(after.parking.disk.pool.get("s1"), last_used_at=0.0).on_disk
