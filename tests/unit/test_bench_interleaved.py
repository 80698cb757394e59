"""`memrad bench interleaved` on a tiny model: both arms run the same interleaved requests."""

from memrad.bench.affinity_turns import client_arguments
from memrad.bench.interleaved_turns import run, same_pick
from memrad.request import Identity


def test_both_arms_run_the_agent_and_its_sub_agent_alternately_and_on_never_reuses_less(loaded):
    args = client_arguments("x", turns=3, max_tokens=4).parse_args(["--chunk", "16"])
    rows = run(loaded["llama"], args, 1, Identity("bench", "session_id"), system="You are a coding agent. " * 4,
               tool="src/app.py: def main(): pass")
    assert [(r["who"], r["turn"]) for r in rows] == [
        ("agent", 1), ("sub-agent", 1), ("agent", 2), ("sub-agent", 2), ("agent", 3), ("sub-agent", 3)]
    assert all(r["on"].text == r["off"].text for r in rows)
    assert all(r["on"].cached_tokens >= r["off"].cached_tokens for r in rows)
    assert rows[0]["on"].decision.render() == "cold (nothing parked for this model and cache_salt)"
    # from turn 2 each resumes its own previous prompt in the on arm
    assert all(r["on"].decision.outcome == "resumed" and "forked" not in r["on"].decision.render()
               for r in rows[2:])


def test_after_the_agent_ran_once_before_both_arms_pick_the_same_resumes_and_say_what_they_cost(loaded):
    """--warm --rewrite first-sentence (issue 37's held-out client): the earlier run's parked
    state competes with the agent's own; affinity on picks what off picks, request by request."""
    args = client_arguments("x", turns=3, max_tokens=6).parse_args(["--chunk", "16"])
    args.rewrite, args.warm = "first-sentence", True
    rows = run(loaded["llama"], args, 1, Identity("bench", "session_id"), system="You are a coding agent. " * 4,
               tool="src/app.py: def main(): pass")
    assert len(rows) == 6 and all(same_pick(r["on"], r["off"]) for r in rows)
    assert all(r["on"].text == r["off"].text and r["on"].cached_tokens == r["off"].cached_tokens for r in rows)
    first = rows[0]["on"].decision  # the agent's turn 1 forks the earlier run's state
    assert first.outcome == "resumed" and "forked" in first.reason and first.copied_rows == first.checkpoint
    assert first.copied_bytes > 0 and first.checkout_s is not None
    assert first.render_cost().startswith(f"cost: primed {first.primed_tokens} tokens, copied {first.checkpoint} rows (")


def test_the_control_run_makes_both_arms_affinity_off(loaded):
    """--control (the A/A run read before on/off): no request of either arm resumes by name."""
    args = client_arguments("x", turns=2, max_tokens=4).parse_args(["--chunk", "16"])
    args.control = True
    rows = run(loaded["llama"], args, 1, Identity("bench", "session_id"), system="You are a coding agent. " * 4,
               tool="src/app.py: def main(): pass")
    decisions = [r[arm].decision.render() for r in rows for arm in ("on", "off")]
    assert not any(d.startswith("affinity") for d in decisions)
    assert [r["on"].decision.render() for r in rows] == [r["off"].decision.render() for r in rows]
