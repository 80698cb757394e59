"""The decode step's AOTInductor package: built by the first start, opened by the next.

A first Decoder builds the package into the compile cache. A second one in the same
configuration opens it without exporting, compiling or tracing anything (each is made to
fail), decodes the same logits bit for bit (with memra's attention kernel, called by name
from the package; with torch's attention, through both graphs, short and split), within the
compiled tolerance of the eager step, and computes with the step's own weights (the package
holds none of them). Another configuration names another file.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memrad.engine.decode import builder
from memrad.engine.decode import package as step_package
from memrad.engine.decode.steps import llama as decode_step
from memrad.engine.kernels import decode_attention
from memrad.engine.decode.decoder import Decoder, cxx_compiler
from memrad.engine.forward import prefill
from memrad.engine.model.loader import load_model
from memrad.engine.decode.package import PackagedStep
from test_decode_step import PROMPT, new_cache


def load(q4_dir, dtype="bfloat16"):
    torch.set_num_threads(1)
    return load_model(str(q4_dir), device="cpu", dtype=dtype, weights="int4")


@pytest.mark.skipif(cxx_compiler() is None, reason="building the package needs a C++ compiler")
@pytest.mark.parametrize("kernel,graphs", [(True, ["kernel"]), (False, ["short", "split"])])
def test_a_second_decoder_opens_the_package_and_decodes_what_the_first_did(q4_dir, tmp_path, monkeypatch,
                                                                           kernel, graphs):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty compile cache
    monkeypatch.setattr(decode_step, "SPLIT_ROWS", len(PROMPT) + 4)  # 8 steps cross into the split graph
    if not kernel:
        monkeypatch.setattr(decode_attention, "load", lambda *args, **kwargs: "switched off by the test")
    loaded = load(q4_dir)
    first = Decoder(loaded.model, loaded.context_len, loaded.device, "on")
    first.start()
    assert first.choice.value == "compiled" and "package built" in first.choice.reason, first.choice.reason
    assert list(first.step.runners) == graphs and first.current[1] == kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the second start compiled")

    monkeypatch.setattr(step_package, "build", refuse)
    monkeypatch.setattr(torch, "compile", refuse)
    second = Decoder(loaded.model, loaded.context_len, loaded.device, "auto")
    second.start()  # auto: opened at once, no background thread
    assert second.choice.value == "compiled" and "from the compile cache" in second.choice.reason
    assert isinstance(second.step, PackagedStep) and second._thread is None

    feeds = [first.feeder(), second.feeder(), Decoder(loaded.model, loaded.context_len, loaded.device).feeder()]
    caches = [new_cache(loaded) for _ in feeds]
    logits = [prefill(loaded.model, cache, PROMPT, 0, 16) for cache in caches]
    for step in range(8):  # attended lengths 41..48: short up to 43, split from 44
        token = int(logits[2].argmax())
        logits = [feed(cache, token, len(PROMPT) + step) for feed, cache in zip(feeds, caches)]
        assert torch.equal(logits[0], logits[1]), step
        assert torch.isfinite(logits[1]).all() and (logits[1] - logits[2]).abs().max() <= 0.01, step
    assert caches[1].get_seq_length() == len(PROMPT) + 8  # the package wrote its KV rows in place

    with torch.no_grad():
        second.eager.norm.weight.zero_()  # the model's own final norm: the package reads it, not a copy
    assert not second.feeder()(caches[1], 5, len(PROMPT) + 8).any()


def test_another_configuration_names_another_package(q4_dir, monkeypatch):
    bf16, fp32 = load(q4_dir), load(q4_dir, "float32")

    def path(loaded, capacity=64, kernel=True):
        step = decode_step.DecodeStep(loaded.model, loaded.context_len)
        return step_package.package_path(step, loaded.model.config, capacity, kernel, Path("/cache"))

    same = path(bf16)
    assert same == path(bf16) and same.name.startswith("decode-step-") and "-int4-bfloat16-attn-memra-" in same.name
    assert path(fp32) != same and path(bf16, capacity=128) != same and path(bf16, kernel=False) != same
    monkeypatch.setattr(decode_step, "SPLIT_ROWS", 32)
    assert path(bf16) != same


def test_pruning_keeps_the_most_recently_used_packages(tmp_path):
    for age, name in enumerate(["a", "b", "c", "d"]):
        package = tmp_path / f"decode-step-{name}.pt2"
        package.write_bytes(b"pt2")
        step_package.constants_path(package).write_bytes(b"constants")
        os.utime(package, (1000 - age, 1000 - age))  # a newest, d oldest
    building = f"decode-step-x.{os.getpid()}.partial.pt2"
    (tmp_path / building).write_bytes(b"being built by a process that runs")
    abandoned = tmp_path / f"decode-step-y.{os.getpid()}.partial.pt2"
    abandoned.write_bytes(b"a build stopped two hours ago (its pid reused since)")
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    killed = _dead_pid()
    (tmp_path / f"decode-step-z.{killed}.partial.pt2").write_bytes(b"a child killed mid-build")
    (tmp_path / f"decode-step-z.constants.{killed}.partial").write_bytes(b"its constants")
    gone = step_package.prune(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == [
        "decode-step-c.pt2", "decode-step-d.pt2", f"decode-step-y.{os.getpid()}.partial.pt2",
        f"decode-step-z.{killed}.partial.pt2", f"decode-step-z.constants.{killed}.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode-step-a.constants.safetensors", "decode-step-a.pt2", "decode-step-b.constants.safetensors",
        "decode-step-b.pt2", building]


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_packages_live_in_memras_cache_unless_a_directory_was_chosen(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from memrad.engine.decode.builder import compile_cache_dir

    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "memra"))
    # What inductor writes into the variable the first time anything asks (a model load does).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert compile_cache_dir() == str(tmp_path / "memra" / "compile")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "memra" / "compile")  # inductor's too
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    assert compile_cache_dir() == str(tmp_path / "chosen")


@pytest.mark.skipif(cxx_compiler() is None, reason="building the package needs a C++ compiler")
def test_a_child_builds_the_package_the_daemon_would_and_refuses_any_other_name(q4_dir, tmp_path, monkeypatch):
    # The engine builds in a child process (the daemon's interpreter keeps serving); the child
    # loads the model from the recipe and must arrive at the very step the parent holds.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    loaded = load(q4_dir)
    recipe = builder.Recipe.of(loaded)
    parent = Decoder(loaded.model, loaded.context_len, loaded.device, "on", recipe)
    kernel = decode_attention.load(cxx_compiler()) is None
    wrong = parent._package(kernel).with_name("decode-step-elsewhere.pt2")
    with pytest.raises(RuntimeError, match="exited with 3: the child.s step is decode-step-tiny-q40-.*, not decode-step-elsewhere.pt2"):
        builder.build_in_child(recipe, kernel, wrong)
    assert not wrong.exists()
    parent.start()  # the child builds under the parent's name; the parent opens it
    assert parent.choice.value == "compiled" and "package built" in parent.choice.reason, parent.choice.reason
    assert isinstance(parent.step, PackagedStep) and parent._package(kernel).is_file()


@pytest.mark.skipif(cxx_compiler() is None, reason="the batched step needs memra's attention kernel (a C++ compiler)")
@pytest.mark.parametrize("rows,niceness", [(0, []), (2, [10])])
def test_the_batched_steps_build_at_a_lower_priority_than_serving(q4_dir, tmp_path, monkeypatch, rows, niceness):
    # A first start serves on the one-row step while the batched packages build: the child
    # that builds them yields the CPU to the daemon's decode (the one-row build does not)
    loaded = load(q4_dir)
    assert decode_attention.load(cxx_compiler()) is None
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device, "auto", batch_rows=4)
    path = step_package.package_path(decoder.eager, loaded.model.config, decoder.capacity, True, tmp_path, rows or None)
    niced, built = [], []
    monkeypatch.setattr(os, "nice", niced.append)
    monkeypatch.setattr(builder, "die_with", lambda parent: None)
    monkeypatch.setattr(step_package, "build", lambda *args: built.append(args[5]))  # (..., path, rows, phase)
    argv = [str(q4_dir), loaded.dtype_name, loaded.weights_name, str(loaded.context_len), "kernel", str(path),
            str(rows), str(os.getpid()), "1", builder.Recipe.of(loaded).kv_dtype]
    try:
        assert builder.main(argv) == 0
    finally:
        torch.set_num_threads(1)
    assert niced == niceness and built == [rows or None]


def test_the_child_loads_at_the_daemons_thread_count_and_builds_at_one(q4_dir, tmp_path, monkeypatch):
    # The kernel verdicts (memrad.engine.model.kernel_choice) are measured and kept per thread
    # count: a child loading at one thread where the daemon loaded at two measured anew, chose
    # another kernel for a group (Q6_K: 948 vs 976 us at two threads, 1609 vs 1027 at one, Zen 2)
    # and refused to build under the daemon's name. The recipe carries the load's threads.
    torch.set_num_threads(2)
    try:
        loaded = load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
    finally:
        torch.set_num_threads(1)
    assert loaded.threads == 2
    recipe = builder.Recipe.of(loaded)
    args = []
    monkeypatch.setattr(builder, "run_child", lambda argv, timeout_s, phase: args.extend(argv))
    builder.build_in_child(recipe, True, tmp_path / "step.pt2")
    at_load, at_build = [], []
    monkeypatch.setattr(builder, "die_with", lambda parent: None)
    monkeypatch.setattr("memrad.engine.model.loader.load_model",
                        lambda *a, **k: at_load.append(torch.get_num_threads()) or loaded)
    monkeypatch.setattr(step_package, "package_path", lambda *a: tmp_path / "step.pt2")
    monkeypatch.setattr(step_package, "build", lambda *a: at_build.append(torch.get_num_threads()))
    try:
        assert builder.main(args[3:]) == 0  # after the interpreter, "-m" and the module
    finally:
        torch.set_num_threads(1)
    assert args[-2:] == ["2", recipe.kv_dtype] and at_load == [2] and at_build == [1]
