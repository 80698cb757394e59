"""Fixtures for the integration tests; the harness itself is in daemon_harness.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon_harness import Daemon

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Every test in this folder runs the real model: make sure each carries the marker."""
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def make_daemon(tmp_path_factory):
    """Factory for isolated daemons (not started); every one is stopped at module teardown."""
    made: list[Daemon] = []

    def make() -> Daemon:
        daemon = Daemon(tmp_path_factory.mktemp("memrad"))
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.shutdown()


@pytest.fixture(scope="module")
def daemon(make_daemon) -> Daemon:
    """One running daemon shared by a module's tests."""
    d = make_daemon()
    result = d.start()
    if result.returncode != 0:
        pytest.fail(f"`memrad start` failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}\n"
                    f"log:\n{d.log_text()[-3000:]}")
    if not d.pidfile.is_file():
        pytest.fail(f"the daemon did not write its pidfile in the isolated runtime dir {d.runtime_dir}")
    return d


@pytest.fixture(scope="session")
def smol():
    """The default model loaded in this process (pulled into the cache on first use)."""
    import torch

    from memrad.engine.model.loader import load_model

    torch.set_num_threads(2)
    return load_model("default", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def smol_served():
    """The default model as the daemon serves it (auto dtype and weights: bf16 and int4 here),
    loaded in this process, once per module."""
    import torch

    from memrad.engine.model.loader import load_model

    torch.set_num_threads(2)
    return load_model("default", device="cpu", dtype="auto")
