"""Build estimates: the last build of a package's family on this machine, never a guess; and
the batched packages asked for only when a second request decodes beside another."""

import threading

from memrad.engine.decode import build_times
from memrad.engine.decode import package as step_package
from memrad.engine.decode.decoder import Decoder
from memrad.request import GenerationRequest, SamplingParams
from stories import make_engine
from test_reuse import SYSTEM

ONE_ROW = "decode-step-SmolLM2-135M-Instruct-int4-bfloat16-attn-memra-torch2.13.0_cpu-avx512"


def test_an_estimate_is_the_last_build_of_the_same_family_here(tmp_path):
    built = tmp_path / f"{ONE_ROW}-c5ce72ad69a4b831.pt2"
    assert build_times.family(built) == ONE_ROW
    assert build_times.estimate(built) == "no earlier build here to time it by"
    build_times.record(built, 412.34)
    rebuilt = tmp_path / f"{ONE_ROW}-0123456789abcdef.pt2"  # another key (new code): the same family
    assert build_times.last_build_s(rebuilt) == 412.3
    assert build_times.estimate(rebuilt) == "~412 s (the last build here)"
    batched = tmp_path / f"{ONE_ROW.replace('Instruct-', 'Instruct-rows2-')}-c5ce72ad69a4b831.pt2"
    assert build_times.estimate(batched) == "no earlier build here to time it by"  # another family


def test_a_damaged_times_file_loses_only_the_estimate(tmp_path):
    built = tmp_path / f"{ONE_ROW}-c5ce72ad69a4b831.pt2"
    (tmp_path / build_times.FILE).write_text("{not json")
    assert build_times.last_build_s(built) is None
    build_times.record(built, 30.0)
    assert build_times.last_build_s(built) == 30.0


def request(engine, topic):
    text, ids = engine.chat.render([SYSTEM, {"role": "user", "content": topic}], None)
    return GenerationRequest(topic, engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=4))


def test_only_a_second_request_in_flight_asks_for_the_batched_packages(tiny_loaded):
    engine = make_engine(tiny_loaded, 16, compile="auto", max_batch=2)
    decoder = engine.decoder
    engine.admit(request(engine, "a"), lambda _: None, lambda: False)
    assert not decoder._batch_wanted  # alone: nothing batched is built for it
    engine.admit(request(engine, "b"), lambda _: None, lambda: False)
    assert decoder._batch_wanted and not decoder.compiling()  # the one-row step is eager here: nothing to build on


def test_the_batched_packages_build_once_in_the_background(tiny_loaded, monkeypatch):
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto", batch_rows=4)
    packaged = object.__new__(step_package.PackagedStep)  # the one-row package, opened
    decoder.current = (packaged, True)
    builds, release = [], threading.Event()
    monkeypatch.setattr(decoder, "_compile_batch", lambda kernel: builds.append(kernel) or release.wait(30))
    decoder.want_batch()
    assert decoder.batch_choice.value == "compiling" and decoder.compiling()
    decoder.want_batch()  # a third request: the build is already under way
    release.set()
    decoder.wait()
    assert builds == [True]


def test_a_second_request_during_the_one_row_build_has_the_batched_packages_built_after_it(tiny_loaded, monkeypatch):
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto", batch_rows=4)
    packaged = object.__new__(step_package.PackagedStep)
    landed, builds = threading.Event(), []

    def one_row():
        assert landed.wait(30)
        decoder.current = (packaged, True)

    monkeypatch.setattr(decoder, "_open_package", lambda: False)
    monkeypatch.setattr(decoder, "_compile", one_row)
    monkeypatch.setattr(decoder, "_compile_batch", builds.append)
    decoder.start()
    assert decoder.batch_choice.value == "on demand"
    decoder.want_batch()  # while the one-row step builds: it takes the batched ones on when it lands
    assert builds == []
    landed.set()
    decoder.wait()
    assert builds == [True]


def test_without_a_second_request_the_one_row_build_builds_nothing_batched(tiny_loaded, monkeypatch):
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto", batch_rows=4)
    builds = []
    monkeypatch.setattr(decoder, "_open_package", lambda: False)
    monkeypatch.setattr(decoder, "_compile", lambda: setattr(decoder, "current", (object.__new__(
        step_package.PackagedStep), True)))
    monkeypatch.setattr(decoder, "_compile_batch", builds.append)
    decoder.start()
    decoder.wait()
    assert builds == [] and decoder.batch_choice.value == "on demand"


def test_a_first_start_makes_the_eager_batched_step_before_its_first_request(tiny_loaded, monkeypatch):
    engine = make_engine(tiny_loaded, 16, compile="off", max_batch=2)
    made = []
    make = engine.decoder._made_batch_step
    monkeypatch.setattr(engine.decoder, "_made_batch_step",
                        lambda *args: made.append((threading.current_thread().name, args)) or make(*args))
    engine.start_background()
    for thread in threading.enumerate():
        if thread.name == "memrad-batch-check":
            thread.join(60)
    assert made == [("memrad-batch-check", (2, True, False))]
    flight = engine.admit(request(engine, "a"), lambda _: None, lambda: False)
    assert flight.feed is engine.decoder._batched[(2, True, False)]  # the one made ahead, not another
    assert len(made) == 2  # the engine asked, under the lock, and found it made


def test_pull_prints_each_build_with_its_estimate_as_it_starts(tiny_loaded, monkeypatch, tmp_path, capsys):
    from memrad.cli import _Ticker

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto")
    path = decoder._package(False)
    build_times.record(path, 61.4)
    monkeypatch.setattr("memrad.engine.decode.builder.build_package", lambda *args: path.write_bytes(b"built"))
    with _Ticker() as ticker:  # not a terminal here: the lines only, no ticking
        decoder._build_package(False, None, ticker.building)
    assert capsys.readouterr().out == ("building the decode step (one row, torch's attention): "
                                       "~61 s (the last build here)\n")
    assert build_times.last_build_s(path) is not None and build_times.last_build_s(path) < 61.4  # this build's time


def test_the_bar_runs_against_the_last_build_here_else_against_the_phases():
    exporting = build_times.PHASES[1]
    timed = build_times.Progress("the decode step (one row, memra's attention kernel)", 97.0, exporting)
    assert timed.line(29) == "[######..............]  29 s of ~97 s (the last build here); exporting the graph (2/4)"
    assert timed.line(120) == ("[####################] 120 s, past the ~97 s the last build here took; "
                               "exporting the graph (2/4)")
    untimed = build_times.Progress("the decode step (one row, memra's attention kernel)", None, exporting)
    assert untimed.line(29) == ("[#####...............] phase 2/4, exporting the graph; 29 s "
                                "(no earlier build here to time it by)")  # phases done, never a guess
    assert build_times.Progress("x", None).line(3) == "[....................] 3 s (no earlier build here to time it by)"


def test_pull_prints_each_phase_of_a_build_off_a_terminal(tiny_loaded, monkeypatch, tmp_path, capsys):
    from memrad.cli import _Ticker

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto")
    path = decoder._package(False)

    def build(*args):  # as the child reports them
        for phase in build_times.PHASES:
            args[-1](phase)
        path.write_bytes(b"built")

    monkeypatch.setattr("memrad.engine.decode.builder.build_package", build)
    with _Ticker() as ticker:
        decoder._build_package(False, None, ticker.building)
    assert capsys.readouterr().out == (
        "building the decode step (one row, torch's attention): no earlier build here to time it by\n"
        "  phase 1/4: loading the model\n  phase 2/4: exporting the graph\n"
        "  phase 3/4: compiling (inductor's codegen, then g++)\n  phase 4/4: writing the package\n")


def test_a_first_start_says_which_phase_the_one_row_build_is_in(tiny_loaded, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    decoder = Decoder(tiny_loaded.model, tiny_loaded.context_len, tiny_loaded.device, "auto")
    build_times.record(decoder._package(False), 97.0)
    monkeypatch.setattr("memrad.engine.decode.decoder.decode_attention.load", lambda *a, **k: "off in this test")
    reasons, stop = [], RuntimeError("stopped after the export (the test)")

    def build(*args):
        args[-1](build_times.PHASES[1])
        reasons.append(decoder.choice.reason)
        raise stop

    monkeypatch.setattr("memrad.engine.decode.builder.build_package", build)
    monkeypatch.setattr("memrad.engine.decode.builder.torch_compiled", lambda *a: (_ for _ in ()).throw(stop))
    decoder.start()
    decoder.wait()
    assert reasons == ["compile = auto: new requests decode on the eager step until the compiled step is ready, "
                       "each on the step it started on to its last token; building the one-row step: "
                       "exporting the graph (2/4), ~97 s (the last build here)"]


def test_a_build_child_s_phases_reach_the_parent_as_they_come_and_its_failure_says_why():
    import sys

    import pytest

    from memrad.engine.decode import builder

    heard = []
    script = ("import sys; print('memra-phase: loading the model', flush=True); print('other output');"
              "print('memra-phase: exporting the graph', flush=True); print('no such weights', file=sys.stderr);"
              "sys.exit(4)")
    with pytest.raises(RuntimeError, match="^the package build exited with 4: no such weights$"):
        builder.run_child([sys.executable, "-c", script], 60, heard.append)
    assert heard == ["loading the model", "exporting the graph"] and not builder._children
    with pytest.raises(RuntimeError, match="^building the package took more than 1 s$"):
        builder.run_child([sys.executable, "-c", "import time; time.sleep(30)"], 1, heard.append)


def test_pull_redraws_the_bar_in_place_on_a_terminal(monkeypatch, capsys):
    from memrad.cli import _Ticker

    ticker = _Ticker()
    ticker._terminal = True  # as on a terminal; the once-a-second redraw is not started here
    monkeypatch.setattr("memrad.cli.time.monotonic", lambda: 100.0)
    ticker.building(build_times.Progress("the decode step (one row, memra's attention kernel)", 97.0))
    monkeypatch.setattr("memrad.cli.time.monotonic", lambda: 129.0)
    ticker.building(build_times.Progress("the decode step (one row, memra's attention kernel)", 97.0,
                                         build_times.PHASES[1]))
    assert capsys.readouterr().out == (
        "\r\033[Kbuilding the decode step (one row, memra's attention kernel): ~97 s (the last build here)\n"
        "\r\033[K  [....................]   0 s of ~97 s (the last build here)"
        "\r\033[K\r\033[K  [######..............]  29 s of ~97 s (the last build here); exporting the graph (2/4)")
