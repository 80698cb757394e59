"""One team of intra-op threads: the engine thread's (memrad.engine.threads)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from memrad import daemon
from memrad.config import ModelSettings, Settings
from memrad.engine.state.disk import DiskTier
from memrad.engine.threads import on_passing_thread, pin, quota_cpus


def _on_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_pinned_count_survives_another_thread_setting_its_own():
    # torch applies the process-wide count (the last set on any thread) to a thread at its first
    # parallel op: a count set without pin is lost when another thread sets one in between
    order = [threading.Event() for _ in range(2)]
    seen = {}

    def engine(how):
        how(2)
        order[0].set()
        order[1].wait()
        seen[how.__name__] = torch.get_num_threads()

    for how in (torch.set_num_threads, pin):
        order[0].clear(), order[1].clear()
        thread = threading.Thread(target=engine, args=(how,))
        thread.start()
        order[0].wait()
        _on_thread(lambda: pin(1))
        order[1].set()
        thread.join()
    assert seen == {"set_num_threads": 1, "pin": 2}


def test_on_passing_thread_runs_on_a_thread_that_ends_with_the_count_asked():
    ran = on_passing_thread(lambda: (threading.current_thread(), torch.get_num_threads()), 2)
    assert ran[0] is not threading.current_thread() and not ran[0].is_alive() and ran[1] == 2
    with pytest.raises(ValueError, match="bad weights"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad weights")), 2)


def test_the_daemon_loads_off_its_main_thread_which_keeps_one_intra_op_thread(monkeypatch):
    loads = []

    def build_engine(settings):
        loads.append((threading.current_thread(), torch.get_num_threads()))
        return SimpleNamespace(loaded=SimpleNamespace(device=SimpleNamespace(type="cpu"), dtype_name="bfloat16"))

    monkeypatch.setattr("memrad.engine.build.build_engine", build_engine)
    settings = Settings(model=ModelSettings(threads=2))

    def serve_thread():
        daemon._load(settings)
        return torch.get_num_threads()

    assert _on_thread(serve_thread) == 1  # the thread that serves HTTP never forms a team
    (loader, threads), = loads
    assert loader.name == "memrad-load" and not loader.is_alive() and threads == 2


def test_the_spill_writer_keeps_one_intra_op_thread(tmp_path):
    pin(2)  # the count the writer thread would otherwise inherit
    tier = DiskTier(tmp_path, 10**9, {})
    done = threading.Event()
    seen = []
    tier.spill_later(SimpleNamespace(session_id="s1", state=None), lambda _: None,
                     lambda _, why: (seen.append((why, torch.get_num_threads())), done.set()))
    assert done.wait(10)
    assert seen == [("it holds no state", 1)]


def test_the_team_applies_each_phases_count_and_reports_a_change_with_its_reason():
    from memrad.engine.team import Ceiling, TeamPolicy
    from memrad.engine.threads import Team

    now, limits, changes = [0.0], [Ceiling(2, "2 CPUs in the affinity mask")], []
    team = Team(TeamPolicy(limits[0]), on_change=changes.append, clock=lambda: now[0], ceiling=lambda: limits[0])
    before = torch.get_num_threads()
    try:
        pin(2)
        for step in range(2000):  # 7 s quiet (a probe at 1 loses at 5 s), then one busy process beside
            threads = team.size_for("decode")
            assert torch.get_num_threads() == threads
            started = now[0]
            now[0] += {2: 0.010 if step < 700 else 0.040, 1: 0.018}[threads]
            team.ran("decode", threads, 1, started)
            if changes:
                break
        assert [c.render() for c in changes] == ["decode 2 → 1: steps 4.0x their quiet time for 3 s"]
        assert team.size_for("decode") == 1 == torch.get_num_threads() and team.policy.count("prefill") == 2
        limits[0] = Ceiling(1, "the cgroup quota allows 1.5 CPUs")  # read again within LIMITS_EVERY_S
        now[0] += 5.0
        team.size_for("prefill")
        assert [c.render() for c in changes[1:]] == ["prefill 2 → 1: the cgroup quota allows 1.5 CPUs",
                                                 "batch 2 → 1: the cgroup quota allows 1.5 CPUs"]
    finally:
        torch.set_num_threads(before)


def test_a_fixed_count_leaves_the_pinned_count_alone():
    from memrad.engine.team import Ceiling, TeamPolicy
    from memrad.engine.threads import Team

    before = torch.get_num_threads()
    try:
        pin(1)
        team = Team(TeamPolicy(Ceiling(2, "set by model.threads"), fixed=2), ceiling=lambda: Ceiling(1, "x"))
        assert team.size_for("decode") == 2 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def cgroup_tree(tmp_path, proc_lines, files):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "self").write_text("\n".join(proc_lines) + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "fs", tmp_path / "self"


def test_the_quota_is_read_from_the_processs_own_cgroup_and_its_ancestors(tmp_path):
    # v2: the tightest of the own cgroup's cpu.max and its parents'
    root, me = cgroup_tree(tmp_path / "v2", ["0::/box/job"], {"box/job/cpu.max": "max 100000",
                                                                 "box/cpu.max": "150000 100000"})
    assert quota_cpus(root, me) == 1.5
    # v1: the cpu controller's own cgroup (a `docker run --cpus 1.5` or a sub-cgroup beside a shell)
    root, me = cgroup_tree(tmp_path / "v1", ["4:memory:/x", "1:cpu:/memra15", "0::/"],
                           {"cpu/memra15/cpu.cfs_quota_us": "150000\n", "cpu/memra15/cpu.cfs_period_us": "100000\n",
                            "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert quota_cpus(root, me) == 1.5
    # v1 in a container: the mount shows the container's own cgroup at its root
    root, me = cgroup_tree(tmp_path / "ctr", ["3:cpu,cpuacct:/docker/abc", "0::/"],
                           {"cpu,cpuacct/cpu.cfs_quota_us": "50000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert quota_cpus(root, me) == 0.5
    root, me = cgroup_tree(tmp_path / "none", ["1:cpu:/", "0::/"], {"cpu/cpu.cfs_quota_us": "-1",
                                                                    "cpu/cpu.cfs_period_us": "100000"})
    assert quota_cpus(root, me) is None
