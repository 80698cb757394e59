"""The thread count per phase follows the CPU actually free (memrad.engine.team): pure policy,
fed step timings; no torch."""

from memrad.engine.team import Ceiling, TeamPolicy, ceiling_of, parse_cpu_max

TWO = Ceiling(2, "2 CPUs in the affinity mask")


def run(policy, phase, seconds_at, start_s, steps, step_s_of=None, work=1):
    """Run `steps` steps of `phase` from `start_s`: each takes seconds_at[count] (per unit of
    work); returns (the changes, the time after, the counts the steps ran at)."""
    now, changes, counts = start_s, [], []
    for _ in range(steps):
        n = policy.threads_for(phase, now)
        took = seconds_at[n] * work
        now += took
        counts.append(n)
        change = policy.observe(phase, n, work, took, now)
        if change is not None:
            changes.append((change.phase, change.before, change.after, change.reason))
    return changes, now, counts


def test_the_ceiling_is_the_affinity_mask_lowered_to_the_cgroup_quota_rounded_up():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert ceiling_of(2, None) == Ceiling(2, "2 CPUs in the affinity mask")
    assert ceiling_of(2, 1.5) == Ceiling(2, "2 CPUs in the affinity mask")  # 2 threads run 1.5 CPUs' work
    assert ceiling_of(4, 1.5) == Ceiling(2, "the cgroup quota allows 1.5 CPUs")
    assert ceiling_of(4, 0.5) == Ceiling(1, "the cgroup quota allows 0.5 CPUs")
    assert ceiling_of(2, 3.0) == Ceiling(2, "2 CPUs in the affinity mask")


def test_a_busy_machine_shrinks_decode_by_one_after_three_slow_seconds_and_says_why():
    policy = TeamPolicy(TWO)
    quiet = {2: 0.010, 1: 0.018}
    changes, now, counts = run(policy, "decode", quiet, 0.0, 700)  # 7 s quiet (a probe at 1 lost at 5 s)
    assert changes == [] and policy.count("decode") == 2
    busy = {2: 0.041, 1: 0.019}  # one busy process: the 2-thread team waits for its straggler
    changes, now, counts = run(policy, "decode", busy, now, 200)
    assert changes == [("decode", 2, 1, "steps 4.1x their quiet time for 3 s")]
    assert policy.reason("decode") == "2 → 1: steps 4.1x their quiet time for 3 s"
    assert policy.count("prefill") == 2 and policy.count("batch") == 2  # each phase on its own


def test_a_quiet_probe_grows_the_team_back_and_a_busy_one_backs_off():
    policy = TeamPolicy(TWO)
    _, now, _ = run(policy, "decode", {2: 0.010, 1: 0.018}, 0.0, 700)
    _, now, _ = run(policy, "decode", {2: 0.041, 1: 0.019}, now, 200)
    assert policy.count("decode") == 1
    # still busy: probes at 2 lose, each one later than the last (5 s, 10 s, 20 s, ...)
    changes, after, counts = run(policy, "decode", {2: 0.041, 1: 0.019}, now, 3000)
    assert changes == [] and policy.count("decode") == 1
    probe_steps = [i for i, n in enumerate(counts) if n == 2]
    assert len(probe_steps) == 2 * 3  # probes of 2 steps at +5, +15, +35 s in ~57 s
    # quiet again: the next probe wins
    changes, _, _ = run(policy, "decode", {2: 0.010, 1: 0.018}, after, 6000)
    assert changes == [("decode", 1, 2, "a probe at 2 ran 0.56x the time of the steps at 1")]


def test_a_machine_busy_from_the_start_is_found_by_probing_one_below():
    policy = TeamPolicy(TWO)
    changes, _, counts = run(policy, "prefill", {2: 4.5e-3, 1: 1.9e-3}, 0.0, 40, work=256)
    assert changes == [("prefill", 2, 1, "a probe at 1 ran 0.42x the time of the steps at 2")]
    assert counts[:5] == [2, 2, 2, 2, 2] and policy.count("prefill") == 1


def test_a_quiet_machine_keeps_the_whole_team_and_probes_ever_more_rarely():
    policy = TeamPolicy(TWO)
    changes, _, counts = run(policy, "decode", {2: 0.010, 1: 0.018}, 0.0, 30000)  # 300 s
    assert changes == [] and policy.count("decode") == 2
    assert counts.count(1) == 2 * 6  # probes at 5, 15, 35, 75, 155 s, then every 120 s: 275 s
    assert counts.count(1) / len(counts) < 0.001


def test_steps_that_vary_less_than_the_slow_ratio_never_shrink_the_team():
    policy = TeamPolicy(TWO)
    now = 0.0
    for i in range(3000):  # decode at a growing context: each step a little slower
        n = policy.threads_for("decode", now)
        took = (0.010 + 0.000005 * i) * (1.8 if n == 1 else 1.0)
        now += took
        assert policy.observe("decode", n, 1, took, now) is None


def test_a_fixed_count_never_moves_and_a_lower_quota_brings_the_counts_down():
    fixed = TeamPolicy(TWO, fixed=2)
    assert run(fixed, "decode", {2: 0.041, 1: 0.019}, 0.0, 500)[0] == []
    assert fixed.reason("decode") == "set by model.threads" and fixed.set_ceiling(Ceiling(1, "x"), 1.0) == []
    policy = TeamPolicy(TWO)
    assert policy.set_ceiling(ceiling_of(2, 1.5), 10.0) == []  # rounded up: 2 threads do 1.5 CPUs' work
    changes = policy.set_ceiling(ceiling_of(2, 0.8), 10.0)
    assert [c.render() for c in changes] == [f"{phase} 2 → 1: the cgroup quota allows 0.8 CPUs"
                                             for phase in ("prefill", "decode", "batch")]
    assert changes[1].summary == "prefill 1, decode 1, batch 2"  # every phase's count as it moved
    assert run(policy, "decode", {2: 0.010, 1: 0.018}, 10.0, 2000)[2] == [1] * 2000  # no probes above the ceiling


def test_one_cpu_never_probes():
    policy = TeamPolicy(Ceiling(1, "1 CPUs in the affinity mask"))
    assert run(policy, "batch", {1: 0.02}, 0.0, 1000, work=4)[2] == [1] * 1000


def test_a_steady_phase_keeps_its_starting_count_whatever_its_steps_say():
    policy = TeamPolicy(TWO, steady={"prefill": "exact mode: prefill GEMMs differ by count"})
    changes, _, counts = run(policy, "prefill", {2: 4.5e-3, 1: 1.9e-3}, 0.0, 100, work=256)
    assert changes == [] and counts == [2] * 100
    assert policy.reason("prefill") == "exact mode: prefill GEMMs differ by count"
    assert policy.set_ceiling(Ceiling(1, "the cgroup quota allows 1 CPUs"), 5.0)[0].phase == "decode"
    assert policy.count("prefill") == 2


def test_a_phase_back_from_idle_on_a_busy_machine_probes_at_once_instead_of_after_the_backoff():
    """`memrad bench contended` found it: quiet decode, then 60 s without a step while the
    machine got busy (the quiet time left its window, the probe interval had backed off), and the
    next reply ran whole at 2 threads, 4.5x slow."""
    policy = TeamPolicy(TWO)
    quiet, busy = {2: 0.010, 1: 0.018}, {2: 0.045, 1: 0.019}
    _, now, _ = run(policy, "decode", quiet, 0.0, 7000)  # 70 s quiet: probes at 1 lost, each later
    changes, _, counts = run(policy, "decode", busy, now + 60.0, 10)
    assert counts[:4] == [2, 2, 1, 1]  # two steps at its count, then a probe of two at 1
    assert changes == [("decode", 2, 1, "a probe at 1 ran 0.42x the time of the steps at 2")]


def test_back_from_idle_on_a_quiet_machine_the_probe_loses_and_the_count_stays():
    policy = TeamPolicy(TWO)
    quiet = {2: 0.010, 1: 0.018}
    _, now, _ = run(policy, "decode", quiet, 0.0, 7000)
    changes, _, counts = run(policy, "decode", quiet, now + 60.0, 500)
    assert changes == [] and counts[:4] == [2, 2, 1, 1] and counts[4:].count(1) == 0  # one probe, then none for 5 s
