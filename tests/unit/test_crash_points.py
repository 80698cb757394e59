"""kill -9 at each write step of a spill (memrad.faultpoint): the next start serves, loads
nothing corrupt, and loses at most the session that was being written (issue 23 item 3)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stories
from memrad.engine.decode import builder
from memrad.engine.decode import package as step_package
from memrad.engine.kernels import decode_attention
from memrad.engine.decode.decoder import Decoder, cxx_compiler
from memrad.engine.model.loader import load_model
from memrad.engine.state.disk import DiskTier, state_format

CHUNK = 16
FIRST = [{"role": "system", "content": "You are a helpful coding assistant. " * 3}, {"role": "user", "content": "list files"}]

CRASHING = """
import sys
sys.path[:0] = [{tests!r}]
import torch
torch.set_num_threads(1)
from memrad.engine.model.loader import load_model
from memrad.engine.state.disk import DiskTier, state_format
import stories
loaded = load_model({model!r}, device="cpu", dtype="float32")
engine = stories.make_engine(loaded, {chunk}, max_sessions=1, mode="exact",
                             disk=DiskTier(__import__("pathlib").Path({directory!r}), 10**9,
                                           state_format(loaded, {chunk}, "exact")))
stories.ask(engine, {first!r}, "a", max_tokens=5)
stories.ask(engine, [{{"role": "user", "content": "another conversation"}}], "b", salt="x")  # evicts s1: spill
engine.parking.disk.drain()
print("survived")
"""


@pytest.mark.parametrize("point", ["spill-tmp", "spill-rename", "spill-renamed"])
def test_a_kill_at_each_spill_step_loses_at_most_that_session(tiny_dir, tmp_path, point):
    folder = tiny_dir("llama")
    tests = str(Path(__file__).resolve().parents[1])
    script = CRASHING.format(tests=tests, model=str(folder), chunk=CHUNK, directory=str(tmp_path), first=FIRST)
    env = dict(os.environ, MEMRA_FAULT_KILL=point, PYTHONPATH=os.getcwd())
    crashed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["s1.safetensors"] if point == "spill-renamed" else ["s1.safetensors.%d.tmp" % _pid(left)])

    torch.set_num_threads(1)
    loaded = load_model(str(folder), device="cpu", dtype="float32")
    engine = stories.make_engine(loaded, CHUNK, max_sessions=4, mode="exact",
                                 disk=DiskTier(tmp_path, 10**9, state_format(loaded, CHUNK, "exact")))
    on_disk = [s.session_id for s in engine.parking.disk.pool.sessions()]
    assert [p.name for p in tmp_path.iterdir()] == [f"{sid}.safetensors" for sid in on_disk]  # stray temp gone
    one, _ = stories.ask(engine, FIRST, "cold-again", salt="reference", max_tokens=5)
    second = FIRST + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "open README.md"}]
    (warm, warm_state), (cold, cold_state) = stories.ask(engine, second, "t2"), stories.ask(engine, second, "t2", salt="c")
    if point == "spill-renamed":  # the file was whole: the conversation resumes from it, bit-exact
        assert on_disk == ["s1"] and warm.decision.outcome == "resumed" and warm.decision.candidate == "s1"
        assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold.text
    else:  # the session being written is the one lost; nothing half-written is loaded
        assert on_disk == [] and warm.decision.outcome == "cold" and warm.text == cold.text


def _pid(names):
    return int(names[0].split(".")[2]) if names and names[0].endswith(".tmp") else 0


CONVERTING = """
import sys
sys.path[:0] = [{tests!r}]
from pathlib import Path
from tiny import build_llama, build_tokenizer, write_tiny_gguf
from memrad.engine.model.pull import publish_converted
from memrad.engine.model.weights import quantize_head_q8_0, quantize_layers_q4_1
model = build_llama(400, tied=True)
quantize_layers_q4_1(model)
quantize_head_q8_0(model)
gguf = write_tiny_gguf(Path({gguf!r}), model)
publish_converted(model, build_tokenizer(), gguf, Path({target!r}), print)
print("survived")
"""


@pytest.mark.parametrize("point", ["pull-staged", "pull-publish"])
def test_a_pull_killed_while_converting_publishes_nothing_and_the_next_pull_cleans_up(tmp_path, monkeypatch, point):
    from memrad.engine.model.loader import load_model as load
    from memrad.engine.model.pull import MARKER, ModelUnavailable, has_block_caches, models_dir, sweep_abandoned

    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    target = models_dir() / "tiny-converted"
    tests = str(Path(__file__).resolve().parent)
    script = CONVERTING.format(tests=tests, gguf=str(tmp_path / "tiny.gguf"), target=str(target))
    env = dict(os.environ, MEMRA_FAULT_KILL=point, PYTHONPATH=os.getcwd())
    crashed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    (staging,) = models_dir().iterdir()  # nothing at the model's own name
    assert staging.name.startswith("tiny-converted.") and staging.name.endswith(".partial")
    assert (staging / MARKER).exists() == (point == "pull-publish")  # pull-publish: whole, never renamed
    with pytest.raises(ModelUnavailable, match="not found"):  # a start finds no model, loads nothing
        load(str(target), device="cpu", dtype="float32")

    said = []
    assert sweep_abandoned(said.append) == [staging]  # its pull no longer runs
    assert said == [f"deleted what an interrupted pull left: {staging.name}"] and list(models_dir().iterdir()) == []
    again = subprocess.run([sys.executable, "-c", script], env=dict(env, MEMRA_FAULT_KILL=""), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.endswith("survived\n"), again.stderr[-2000:]
    assert [p.name for p in models_dir().iterdir()] == ["tiny-converted"] and has_block_caches(target)
    assert load(str(target), device="cpu", dtype="float32").model.config.vocab_size == 400


def test_a_pull_that_is_running_keeps_its_files(tmp_path, monkeypatch):
    from memrad.engine.model.pull import models_dir, sweep_abandoned

    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    mine = [models_dir() / f"memra-pull-{os.getpid()}-abc", models_dir() / f"m.{os.getpid()}.partial",
            models_dir() / "m", models_dir() / "m.partial"]  # a model, and staging of an older memrad: no pid
    for folder in mine:
        folder.mkdir()
    assert sweep_abandoned(lambda _: None) == [] and sorted(models_dir().iterdir()) == sorted(mine)


@pytest.mark.skipif(cxx_compiler() is None, reason="building the package needs a C++ compiler")
@pytest.mark.parametrize("point", ["package-staged", "package-rename"])
def test_a_package_build_killed_mid_way_is_never_opened_and_the_next_build_cleans_up(q4_dir, tmp_path, monkeypatch,
                                                                                     point):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty compile cache
    torch.set_num_threads(1)
    loaded = load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
    recipe = builder.Recipe.of(loaded)
    kernel = decode_attention.load(cxx_compiler()) is None
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device, "auto", recipe)
    path = decoder._package(kernel)
    monkeypatch.setenv("MEMRA_FAULT_KILL", point)  # the child inherits it

    def refuse(*args, **kwargs):
        raise AssertionError("a killed build fell back to torch.compile in the serving process")

    monkeypatch.setattr(torch, "compile", refuse)
    decoder.start()
    decoder.wait()
    assert (decoder.choice.value, decoder.choice.reason) == (
        "eager", "auto: the package build was killed (signal 9); the next start builds it again")
    left = sorted(p.name for p in tmp_path.glob("decode-step-*"))
    stem = path.name.removesuffix(".pt2")
    pid = int(next(name for name in left if name.endswith(".partial.pt2")).split(".")[-3])
    constants = [f"{stem}.constants.safetensors"] if point == "package-rename" else []  # staged: none yet
    assert left == sorted([f"{stem}.{pid}.partial.pt2", *constants])  # no package at its own name
    assert not decoder._open_package()  # nothing half-written is opened: the next start compiles again

    monkeypatch.delenv("MEMRA_FAULT_KILL")
    if point == "package-staged":
        assert [p.name for p in step_package.prune(tmp_path)] == [f"{stem}.{pid}.partial.pt2"]  # its builder is gone
        return
    again = Decoder(loaded.model, loaded.context_len, loaded.device, "on", recipe)
    again.start()  # builds anew over the stale constants, prunes the killed build's staging, opens it
    assert again.choice.value == "compiled" and "package built" in again.choice.reason, again.choice.reason
    assert sorted(p.name for p in tmp_path.glob("decode-step-*")) == [f"{stem}.constants.safetensors", path.name]


ORPHANING = """
import sys, threading, time
from pathlib import Path
from memrad.engine.decode import builder
recipe = builder.Recipe({folder!r}, {dtype!r}, {weights!r}, {context_len})
threading.Thread(target=builder.build_in_child, args=(recipe, False, Path({path!r})), daemon=True).start()
while not builder._children:
    time.sleep(0.01)
print(next(iter(builder._children)).pid, flush=True)
time.sleep(600)
"""


def test_a_daemon_killed_while_its_compile_child_builds_leaves_no_build_running(q4_dir, tmp_path, monkeypatch):
    from memrad.process import pid_alive

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty compile cache
    loaded = load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
    path = Decoder(loaded.model, loaded.context_len, loaded.device, "auto")._package(False)  # the child builds this
    script = ORPHANING.format(folder=str(q4_dir), dtype=loaded.dtype_name, weights=loaded.weights_name,
                              context_len=loaded.context_len, path=str(path))
    daemon = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        child = int(daemon.stdout.readline())
        daemon.kill()  # kill -9: no stop, no cleanup in the daemon
        daemon.wait(30)
    finally:
        daemon.kill()
    deadline = time.monotonic() + 120.0  # the child may still be importing torch: it checks its parent then
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = not pid_alive(child)
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone, "the build outlived the daemon that started it"
    assert not list(tmp_path.glob("decode-step-*")), "a build nobody waits for wrote its package"
