from memrad.bench.scenarios import REWRITES, SCENARIOS


def test_client_rewrites():
    reply = "<think>check the config loader\nfirst</think>\n  The loader is in config.py.\n\nSecond paragraph.  "
    assert REWRITES["strip-think"](reply) == "The loader is in config.py.\n\nSecond paragraph.  "
    assert REWRITES["trim"](reply).startswith("<think>") and REWRITES["trim"](reply).endswith("paragraph.")
    assert REWRITES["first-paragraph"](reply) == "<think>check the config loader\nfirst</think>\n  The loader is in config.py."
    assert REWRITES["half"]("abcdef") == "abc"
    assert REWRITES["none"](reply) == reply


def test_the_shipped_scenarios():
    assert len(SCENARIOS["short"].user_turns) == 4
    assert len(SCENARIOS["agent-25"].user_turns) == 25
