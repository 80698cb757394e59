"""A disk-tier file is not trusted: its name is memra's, its path stays in the directory, its
header is checked before any tensor is read, and no single file can stop a start (issue 26,
item 5: each finding reproduced here)."""

import json
import time

import pytest

from memrad.engine.state import sessionfile
from memrad.engine.state.disk import DiskTier, state_format
from memrad.engine.state.sessionfile import header_checksum
import stories
from test_disk import CHUNK, ask, make_engine


def rewrite(path, mutate, fix_checksum=True, data=None, mutate_table=None):
    """Change a file's memra header the way a hostile local user could (re-checksummed unless
    `fix_checksum` is False); `data` replaces the tensor bytes and table, `mutate_table` edits
    the tensor table in place."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    table = json.loads(raw[8:8 + n])
    meta = json.loads(table["__metadata__"]["memra"])
    mutate(meta)
    body = raw[8 + n:]
    if data is not None:
        table, body = {"__metadata__": table["__metadata__"], **data[0]}, data[1]
    if mutate_table is not None:
        mutate_table(table)
    if fix_checksum:
        meta["checksums"]["header"] = header_checksum(meta, {k: v for k, v in table.items() if k != "__metadata__"})
    table["__metadata__"]["memra"] = json.dumps(meta)
    header = json.dumps(table).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)


def one_session(loaded, directory):
    engine = make_engine(loaded, "llama", directory)
    ask(engine, [{"role": "user", "content": "list files " * 4}], "a")
    engine.close()
    return directory / "s1.safetensors"


@pytest.mark.parametrize("claimed", ["../outside/evil", "/ABS/model.safetensors"])
def test_a_header_session_id_is_never_a_path(loaded, tmp_path, claimed):
    sessions, outside = tmp_path / "sessions", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "evil.safetensors"
    victim.write_text("someone else's file")
    claimed = claimed.replace("/ABS", str(outside)).replace("model.safetensors", "evil")
    path = one_session(loaded, sessions)
    rewrite(path, lambda meta: meta["session"].update(session_id=claimed))
    engine = make_engine(loaded, "llama", sessions)
    assert [s.session_id for s in engine.parking.disk.pool.sessions()] == ["s1"]  # the name, not the header
    engine.parking.disk.forget("s1", "test")
    assert victim.read_text() == "someone else's file" and not path.exists()


def test_names_outside_memras_scheme_are_left_alone_and_links_never_followed(loaded, tmp_path):
    sessions = tmp_path / "sessions"
    path = one_session(loaded, sessions)
    target = tmp_path / "model.safetensors"
    target.write_bytes(path.read_bytes())
    (sessions / "model.safetensors").write_bytes(b"a user's file")
    (sessions / "s7.safetensors").symlink_to(target)  # a link named like a session
    (sessions / "s8.safetensors").mkdir()
    engine = make_engine(loaded, "llama", sessions)
    assert [s.session_id for s in engine.parking.disk.pool.sessions()] == ["s1"]
    assert (sessions / "model.safetensors").read_bytes() == b"a user's file"
    assert target.exists() and not (sessions / "s7.safetensors").is_symlink()  # the link went, not its target
    assert (sessions / "s8.safetensors").is_dir()  # rmdir is not unlink: a directory stays, skipped
    with pytest.raises(ValueError, match="not a memra session id"):
        sessionfile.file_name("../s1")


def test_a_changed_header_field_is_skipped_and_the_start_succeeds(loaded, tmp_path, caplog):
    caplog.set_level("INFO", logger="memrad.disk")
    for fix, why in ((False, "header checksum mismatch"), (True, "checkpoints outside its")):
        sessions = tmp_path / f"fix-{fix}"
        path = one_session(loaded, sessions)
        rewrite(path, lambda meta: meta["session"].update(prompt_checkpoint=meta["session"]["prompt_checkpoint"] + 60),
                fix_checksum=fix)
        engine = make_engine(loaded, "llama", sessions)  # used to raise AssertionError at every start
        assert engine.parking.disk.pool.sessions() == [] and not path.exists()
        assert (sessions / "s1.safetensors.bad").exists()  # set aside, not deleted (issue 35, item 5)
        assert f"set aside s1.safetensors in {sessions} as s1.safetensors.bad: {why}" in caplog.text


def test_a_file_over_the_cap_is_skipped_and_the_start_succeeds(loaded, tmp_path, caplog):
    caplog.set_level("INFO", logger="memrad.disk")
    path = one_session(loaded, tmp_path)
    size = path.stat().st_size
    engine = make_engine(loaded, "llama", tmp_path, disk_bytes=size - 1)  # used to raise PoolFull
    assert engine.parking.disk.pool.sessions() == [] and not path.exists()
    assert f"deleted s1.safetensors: {size} bytes: larger than the disk tier's byte cap" in caplog.text


def sparse_foreign(loaded, directory, num_bytes):
    """A valid-header file of another model whose one tensor is `num_bytes` of holes."""
    path = one_session(loaded, directory)
    table = {"token_ids": {"dtype": "I64", "shape": [num_bytes // 8], "data_offsets": [0, num_bytes]}}
    rewrite(path, lambda meta: meta["compat"].update(model="someone-elses-model"), data=(table, b""))
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size + num_bytes)
    return path


def test_a_foreign_sparse_file_is_judged_by_its_header_without_reading_its_tensors(loaded, tmp_path, monkeypatch):
    import safetensors

    path = sparse_foreign(loaded, tmp_path, 800 * 2**20)

    def no_tensor_reads(*args, **kwargs):
        raise AssertionError("a tensor was read at start")

    monkeypatch.setattr(safetensors, "safe_open", no_tensor_reads)
    tier = DiskTier(tmp_path, 2**31, state_format(loaded["llama"], CHUNK, "exact"))
    started = time.perf_counter()
    assert tier.index() == []
    assert time.perf_counter() - started < 1.0  # was 10.4 s and 3.2 GB of RSS
    assert [(f.model, f.num_bytes) for f in tier.foreign.values()] == [("someone-elses-model", path.stat().st_size)]
    small = DiskTier(tmp_path, 2**20, state_format(loaded["llama"], CHUNK, "exact"))
    assert small.index() == [] and not path.exists()  # over this cap: deleted, never read


def test_scan_reports_models_and_problems_without_torch(loaded, tmp_path):
    path = one_session(loaded, tmp_path)
    (tmp_path / "s2.safetensors").write_bytes(b"garbage")
    got = sessionfile.scan(tmp_path)
    assert [(f.session_id, f.model, f.num_bytes) for f in got] == [
        ("s1", loaded["llama"].model_id, path.stat().st_size), ("s2", None, 7)]
    assert got[1].problem.startswith("truncated (no header)") or "header" in got[1].problem


# Issue 35, item 5: the tensor table was outside the checksum, so one edited field raised a
# ValueError at start (every start stopped, the file stayed, the traceback named no file).
TABLE_EDITS = {
    "shape": lambda table: table["token_ids"].update(shape=["x"]),
    "data_offsets": lambda table: table["token_ids"].update(data_offsets=[0, "8"]),
    "dtype": lambda table: table["token_ids"].update(dtype="F64"),
}


@pytest.mark.parametrize("field", list(TABLE_EDITS))
@pytest.mark.parametrize("fix", [False, True])
def test_an_edited_tensor_table_is_set_aside_by_name_and_the_start_goes_on(loaded, tmp_path, caplog, field, fix):
    caplog.set_level("INFO", logger="memrad.disk")
    sessions = tmp_path / "sessions"
    path = one_session(loaded, sessions)
    rewrite(path, lambda meta: None, fix_checksum=fix, mutate_table=TABLE_EDITS[field])
    engine = make_engine(loaded, "llama", sessions)  # used to raise ValueError at every start
    assert engine.parking.disk.pool.sessions() == [] and not path.exists()
    # re-checksummed by whoever edited it: the table must then tile the data, with the tensors memra reads
    why = ("header checksum mismatch" if not fix else
           "no 1-D int64 tensor 'token_ids'" if field == "dtype" else "garbled tensor table (tensor 'token_ids')")
    assert f"set aside s1.safetensors in {sessions} as s1.safetensors.bad: {why}" in caplog.text
    ask(engine, [{"role": "user", "content": "list files " * 4}], "a")  # serves; s1 stays claimed
    assert engine.parking.disk.session_ids() == ["s1"] and engine.close() == []
    assert sorted(p.name for p in sessions.iterdir()) == ["s1.safetensors.bad", "s2.safetensors"]
    cleared = sessionfile.clear(sessions)
    assert [f.session_id for f in cleared] == ["s2"] and list(sessions.iterdir()) == []  # set-aside files too


def test_a_check_this_code_lacks_sets_the_file_aside_and_the_start_goes_on(loaded, tmp_path, caplog, monkeypatch):
    caplog.set_level("INFO", logger="memrad.disk")
    path = one_session(loaded, tmp_path)
    monkeypatch.setattr(DiskTier, "_read", lambda self, name: 1 / 0)
    tier = DiskTier(tmp_path, 2**31, state_format(loaded["llama"], CHUNK, "exact"))
    assert tier.index() == [] and not path.exists()
    assert f"set aside s1.safetensors in {tmp_path} as s1.safetensors.bad: ZeroDivisionError: division by zero" \
        in caplog.text


def test_any_entry_named_after_a_session_id_reserves_it(loaded, tmp_path):
    """Issue 35, item 9: a directory named like a session file was skipped but its id not
    reserved; a later session got it and was lost at `memrad stop` (IsADirectoryError)."""
    (tmp_path / "s1.safetensors").mkdir()
    (tmp_path / "s2").write_text("a user's notes")
    engine = make_engine(loaded, "llama", tmp_path)
    assert engine.parking.disk.session_ids() == ["s1", "s2"]
    ask(engine, [{"role": "user", "content": "list files " * 4}], "a")
    assert engine.close() == []  # written, none lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1.safetensors", "s2", "s3.safetensors"]
    assert (tmp_path / "s1.safetensors").is_dir()
