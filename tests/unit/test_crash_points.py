"""kill -9 at each write step of a spill (memrad.faultpoint): the next start serves, loads
nothing corrupt, and loses at most the session that was being written (issue 23 item 3)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stories
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
