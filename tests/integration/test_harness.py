"""The harness runs the code under test: a daemon started by a test imports memrad from this
checkout, whatever checkout the shared editable install points at (another `pip install -e`
or a merge there between two starts of one test made them run different code)."""

import subprocess
import sys

import daemon_harness
from daemon_harness import CHECKOUT, Daemon


def test_a_daemon_imports_memrad_from_the_checkout_under_test(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as .ci/run and a bare `pytest` call it
    env = Daemon(tmp_path).env
    where = subprocess.run([sys.executable, "-c", "import memrad, memrad.engine.decode.builder as p; "
                            "print(memrad.__file__); print(p.__file__)"],
                           env=env, cwd="/", capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(CHECKOUT / "memrad" / "__init__.py"),
                     str(CHECKOUT / "memrad" / "engine" / "decode" / "builder.py")]  # the compile child's too


def test_the_code_id_changes_with_any_source_and_only_then(tmp_path, monkeypatch):
    before = daemon_harness.code_id()
    assert daemon_harness.code_id() == before
    copy = tmp_path / "checkout"
    (copy / "memrad" / "engine").mkdir(parents=True)
    source = copy / "memrad" / "engine" / "grid.py"
    source.write_text("CHUNK = 256\n")
    monkeypatch.setattr(daemon_harness, "CHECKOUT", copy)
    first = daemon_harness.code_id()
    source.write_text("CHUNK = 128\n")
    assert daemon_harness.code_id() != first
