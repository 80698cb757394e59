"""What a resume costs (memrad.reuse.cost), and the story it decides on a tiny model: a
conversation that ran once before offers one more chunk than the request's own session,
but only as a fork that copies every row below it (issue 37)."""

import stories
from stories import Client

from memrad.reuse.cost import ATTENTION_SPAN, COPY_ROWS_PER_TOKEN, copy_cost, prime_cost, resume_cost

CHUNK = 8
SYSTEM = "You are a helpful coding assistant. Read the file, then answer. " * 22
# tiny llama, fp32 activations, bf16 rows (model.kv_dtype): 2 layers x (keys, values) x 2 KV heads x 16 dims x 2 B
BYTES_PER_ROW = 2 * 2 * 2 * 16 * 2


def test_a_primed_token_costs_more_the_further_in_it_sits_and_a_copy_is_never_free():
    assert prime_cost(0, 100) == 101  # 100 + 100 * 99 // 6400
    assert prime_cost(ATTENTION_SPAN, ATTENTION_SPAN + 10) == 20  # twice as dear at ATTENTION_SPAN
    assert prime_cost(50, 50) == 0
    assert (copy_cost(0), copy_cost(1), copy_cost(COPY_ROWS_PER_TOKEN), copy_cost(COPY_ROWS_PER_TOKEN + 1)) == (0, 1, 1, 2)
    assert resume_cost(1600, 1620, 1616) == prime_cost(1600, 1620) + 26


def test_a_fork_never_costs_more_than_priming_from_zero():
    for prompt in (2, 17, 300, 4096, 32768):
        for checkpoint in range(1, prompt, max(1, prompt // 37)):
            assert resume_cost(checkpoint, prompt, checkpoint) <= resume_cost(0, prompt, 0)


def test_a_replayed_conversation_forks_the_earlier_run_until_the_copy_costs_more_than_it_saves(loaded):
    """The agent's conversation ran once before (its session s16 holds every turn). Replayed,
    each turn is offered its own previous prompt (a replace) and, 8 tokens further, s16's
    next cut (a fork). While the history is short, copying s16's rows costs less than priming
    those 8 tokens; from turn 10 (586 rows to copy, priced 10, against 8 tokens at ~580,
    priced 9 + the rest) it costs more, and the request resumes its own conversation. The
    replies are the earlier run's, whichever state each turn resumed from (exact mode)."""
    engine = stories.make_engine(loaded["llama"], CHUNK, mode="exact")
    earlier = Client(engine, SYSTEM)
    replies = [earlier.say("go", max_tokens=2).text for _ in range(16)]
    again = Client(engine, SYSTEM)
    done = [again.say("go", max_tokens=2) for _ in range(16)]
    assert [c.text for c in done] == replies
    d = [c.decision for c in done]
    assert d[0].render() == "prefix: resumed (longest prefix with s16, 456 of 458; forked)"
    assert (d[0].copied_rows, d[0].copied_bytes, d[0].cost_tokens) == (456, 456 * BYTES_PER_ROW, 10)
    assert d[0].render_cost().startswith("cost: primed 2 tokens, copied 456 rows (0.1 MiB), state ready in ")
    for turn in range(2, 10):  # the fork: 8 tokens more than the request's own session offers
        x, checkpoint = d[turn - 1], 458 + 15 * (turn - 1) - 7
        assert x.render() == (f"affinity: resumed (implicit, {2 * turn} shared segments; checkpoint {checkpoint}; "
                              f"primed 7; forked; weighed token-prefix s{15 + turn} at {checkpoint - 8}, affinity s16 "
                              f"at {checkpoint}: most reuse)"), turn
        assert (x.primed_tokens, x.copied_rows, x.copied_bytes) == (7, checkpoint, checkpoint * BYTES_PER_ROW)
    assert d[9].render() == (
        "token-prefix: resumed (session s25; checkpoint 578; primed 15; weighed token-prefix s25 at 578, affinity s16 "
        "at 586: cheaper resume (forking s16 at 586 copies 586 rows to prime 7: 18 tokens' worth against 17 priming 15))")
    for turn in range(10, 16):  # the replace: nothing copied
        x = d[turn - 1]
        assert (x.tier, x.won_by, x.primed_tokens, x.copied_rows, x.copied_bytes) == (
            "token-prefix", "cheaper resume", 15, None, None), turn
        assert x.render_cost().startswith("cost: primed 15 tokens, nothing copied, state ready in "), turn
    # the last turn holds s16's whole prompt: it continues that session (a replace)
    assert d[15].render().startswith("affinity: resumed (implicit, 33 shared segments; checkpoint 676; primed 7; ")
    assert d[15].copied_rows is None
