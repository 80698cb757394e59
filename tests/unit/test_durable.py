"""A rename that publishes is durable: the staged data reaches the disk before the name
appears, and the directory holding the name after (memrad.durable)."""

import os

from memrad import durable


def _recording(monkeypatch):
    """Every fsync and rename, in order, by the path it touched."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_published_file_is_synced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    staging, final = tmp_path / "s1.safetensors.7.tmp", tmp_path / "s1.safetensors"
    staging.write_bytes(b"state")
    events = _recording(monkeypatch)
    durable.publish(staging, final)
    assert events == [("fsync", str(staging)), ("rename", str(staging), str(final)), ("fsync", str(tmp_path))]
    assert final.read_bytes() == b"state" and not staging.exists()


def test_a_published_folder_has_every_file_and_folder_synced_first(tmp_path, monkeypatch):
    staging, final = tmp_path / "model.7.partial", tmp_path / "model"
    (staging / "sub").mkdir(parents=True)
    (staging / "config.json").write_text("{}")
    (staging / "sub" / "weights").write_bytes(b"w")
    events = _recording(monkeypatch)
    durable.publish(staging, final)
    synced = [e[1] for e in events[:-2]]
    assert sorted(synced) == sorted([str(staging / "config.json"), str(staging / "sub" / "weights"),
                                     str(staging / "sub"), str(staging)])
    assert synced.index(str(staging / "sub" / "weights")) < synced.index(str(staging / "sub"))  # bottom up
    assert events[-2:] == [("rename", str(staging), str(final)), ("fsync", str(tmp_path))]
    assert (final / "sub" / "weights").read_bytes() == b"w"


def test_a_spill_syncs_its_file_before_the_rename_and_the_tier_directory_after(tiny_dir, tmp_path, monkeypatch):
    import torch

    import stories
    from memrad.engine.model.loader import load_model
    from memrad.engine.state.disk import DiskTier, state_format

    torch.set_num_threads(1)
    loaded = load_model(str(tiny_dir("llama")), device="cpu", dtype="float32")
    engine = stories.make_engine(loaded, 16, disk=DiskTier(tmp_path, 10**9, state_format(loaded, 16, "exact")))
    stories.ask(engine, [{"role": "user", "content": "list the files"}], "a", max_tokens=3)
    events = _recording(monkeypatch)
    (session,) = engine.parking.pool.sessions()
    assert engine.parking.disk.spill(session, lambda _: None) is None
    final = str(tmp_path / f"{session.session_id}.safetensors")
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(final + ".") and events[1][2] == final and events[2][1] == str(tmp_path)
