"""The planner's decisions, told as stories over hand-built parked sessions (no model)."""

from dataclasses import replace

from memrad.reuse.planner import RequestView, checkpoint_at_or_below, common_prefix_len, plan, verify
from memrad.reuse.pool import Namespace, ParkedSession

NS = Namespace("m", None)
C = 16


def session(tokens, *, sid="s1", ns=NS, text="", prompt=None, exact=None, croppable=True, checkpoints=()):
    prompt = len(tokens) if prompt is None else prompt
    return ParkedSession(session_id=sid, namespace=ns, identity=None, token_ids=tuple(tokens), text=text,
                         prompt_checkpoint=prompt, checkpoints=tuple(checkpoints), croppable=croppable,
                         exact_limit=(prompt - prompt % C) if exact is None else exact, fingerprint=(), num_bytes=1,
                         created_at=0.0, last_used_at=0.0)


def view(tokens, text="", ns=NS):
    return RequestView("r", tuple(tokens), text, ns)


FIRST = list(range(100, 150))          # a 50-token first prompt
REPLY = [7, 8, 9]                      # the reply's tokens, fed back
SECOND = FIRST + REPLY + [2, 200, 201, 202]


def test_common_prefix():
    assert common_prefix_len((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_len((1, 2), (1, 2, 3)) == 2
    assert common_prefix_len((), (1,)) == 0


def test_exact_mode_resumes_at_the_last_grid_position_of_the_first_prompt():
    parked = session(FIRST + REPLY, prompt=50)
    decided = plan(view(SECOND), [parked], "exact", C)
    assert decided.decision.render() == "token-prefix: resumed (session s1; checkpoint 48; primed 9)"
    assert (decided.checkpoint, decided.decision.reused_tokens, decided.decision.primed_tokens) == (48, 48, 9)
    assert decided.session is parked


def test_fast_mode_reuses_the_prompt_and_the_reply():
    parked = session(FIRST + REPLY, prompt=50)
    decided = plan(view(SECOND), [parked], "fast", C)
    assert decided.decision.render() == "token-prefix: resumed (session s1; checkpoint 53; primed 4)"


def test_text_prefix_nominates_when_the_reply_retokenizes_differently():
    parked = session(FIRST + REPLY, prompt=50, text="<sys>hello<user>hi<asst>Hey")
    retokenized = FIRST + [77, 2, 200]  # same text, other token boundaries in the reply
    decided = plan(view(retokenized, "<sys>hello<user>hi<asst>Hey<end><user>more"), [parked], "exact", C)
    assert decided.decision.render() == "text-prefix: resumed (session s1; checkpoint 48; primed 5)"
    fast = plan(view(retokenized, "<sys>hello<user>hi<asst>Hey<end><user>more"), [parked], "fast", C)
    assert fast.decision.render() == ("text-prefix: resumed (session s1; history diverged at 50 of checkpoint 52; "
                                      "resumed from 50; primed 3)")


def test_a_trimmed_reply_is_not_a_prefix_and_runs_cold():
    parked = session(FIRST + REPLY, prompt=50, text="<sys>hello<user>hi<asst>Hey there")
    trimmed = view(FIRST + [7, 2, 200], "<sys>hello<user>hi<asst>Hey<end><user>more")
    decided = plan(trimmed, [parked], "exact", C, affinity=False, longest_prefix=False)
    assert decided.decision.render() == ("cold (no nomination: no parked session's tokens or text prefix "
                                         "this prompt (1 eligible parked); affinity off)")
    assert decided.session is None and decided.decision.primed_tokens == 53
    # affinity on, but these ids have no control tokens to fingerprint
    assert plan(trimmed, [parked], "exact", C, longest_prefix=False).decision.render() == (
        "cold (no nomination: prompt has no message control tokens to fingerprint)")
    # the longest-prefix tier needs neither: 51 tokens shared, the grid cut below is 48
    assert plan(trimmed, [parked], "exact", C).decision.render() == (
        "prefix: resumed (longest prefix with s1, 48 of 53; replaces it)")


def test_other_namespaces_are_invisible():
    salted = session(FIRST + REPLY, ns=Namespace("m", "tenant-b"))
    other_model = session(FIRST + REPLY, sid="s2", ns=Namespace("other", None))
    decided = plan(view(SECOND), [salted, other_model], "fast", C)
    assert decided.decision.render() == "cold (nothing parked for this model and cache_salt)"


def test_the_longest_extension_is_nominated():
    short = session(FIRST[:20], sid="short", prompt=20)
    long = session(FIRST + REPLY, sid="long", prompt=50)
    assert plan(view(SECOND), [long, short], "fast", C).decision.candidate == "long"
    assert plan(view(SECOND), [short, long], "fast", C).decision.candidate == "long"


def test_the_same_prompt_again_leaves_no_suffix_for_a_recurrent_snapshot():
    parked = session(FIRST, prompt=50, croppable=False, checkpoints=(48, 50), exact=48)
    verdict = verify(parked, tuple(FIRST), "fast", C)
    assert (verdict.checkpoint, verdict.reason) == (48, "checkpoint 48; primed 2")
    only_end = session(FIRST, prompt=50, croppable=False, checkpoints=(50,), exact=0)
    assert verify(only_end, tuple(FIRST), "fast", C).reason == "no suffix to prime (prompt 50 tokens, checkpoint 50)"


def test_a_short_prompt_has_no_exact_checkpoint():
    parked = session(FIRST[:10], prompt=10)
    decided = plan(view(FIRST[:10] + [1, 2]), [parked], "exact", C)
    assert decided.decision.render() == ("token-prefix: declined (no exact checkpoint below the prompt's end "
                                         "(prompt 12 tokens, exact up to 0))")
    assert decided.session is None and decided.decision.reused_tokens == 0


def test_recurrent_sessions_resume_only_from_snapshots():
    parked = session(FIRST + REPLY, prompt=50, croppable=False, checkpoints=(48, 53), exact=48)
    assert plan(view(SECOND), [parked], "exact", C).checkpoint == 48
    assert plan(view(SECOND), [parked], "fast", C).checkpoint == 53
    assert checkpoint_at_or_below(parked, 52, "fast", C) == 48
    assert checkpoint_at_or_below(parked, 47, "fast", C) is None


def test_exact_mode_resumes_at_a_reply_anchor_where_the_request_was_cut_alike_below_it():
    first = list(range(100, 145))  # a 45-token prompt whose reply header started at 40
    parked = replace(session(first + REPLY, prompt=45, exact=45), anchors=(20, 40))
    second = first + REPLY + [2, 200, 201, 202]
    alike = RequestView("r", tuple(second), "", NS, anchors=(20, 40, 49))
    decided = plan(alike, [parked], "exact", C)
    assert decided.decision.render() == "token-prefix: resumed (session s1; checkpoint 40; primed 12)"
    # A request that was not cut at 20 would chunk [16, 32) whole: 40 and 32 are not the
    # same computation for it, so only 16 is.
    unlike = RequestView("r", tuple(second), "", NS, anchors=(40, 49))
    assert plan(unlike, [parked], "exact", C).checkpoint == 16
    # Without anchors the request is not checked (fast mode, or a caller that cannot tell).
    assert plan(view(second), [parked], "exact", C).checkpoint == 40


# --- what a resume costs: the most reuse must never cost time (issue 37) ------------------

HISTORY = list(range(1000, 2600))      # 1,600 tokens of conversation (a multiple of C)
NEXT = HISTORY + REPLY + [2, *range(300, 316)]  # the next turn: 20 tokens past the history


def test_a_fork_that_copies_more_than_it_saves_loses_to_the_requests_own_conversation():
    """The agent's conversation ran once before: that run's session holds this whole prompt
    and offers one more chunk (1,616) than the request's own session (1,600), but only as a
    fork, which copies all 1,616 rows to save priming 16 tokens. The replace is cheaper."""
    own = session(HISTORY + REPLY, prompt=1600, exact=1600, sid="s1")
    earlier = session(NEXT + [7, 8, 2, 9, 9], prompt=len(NEXT) + 3, exact=len(NEXT) + 3, sid="s2")
    decided = plan(view(NEXT), [own, earlier], "exact", C)
    d = decided.decision
    assert d.render() == (
        "token-prefix: resumed (session s1; checkpoint 1600; primed 20; weighed token-prefix s1 at 1,600, "
        "prefix s2 at 1,616: cheaper resume (forking s2 at 1,616 copies 1,616 rows to prime 4: 32 tokens' "
        "worth against 30 priming 20))")
    assert decided.session is own and not decided.fork and decided.checkpoint == 1600
    assert (d.won_by, d.reused_tokens, d.primed_tokens, d.copied_rows, d.cost_tokens) == (
        "cheaper resume", 1600, 20, None, 30)
    assert [(a.tier, a.candidate, a.reused_tokens, a.cost_tokens) for a in d.weighed] == [
        ("token-prefix", "s1", 1600, 30), ("prefix", "s1", 1600, 30), ("prefix", "s2", 1616, 32)]
    assert d.render_cost() == "cost: primed 20 tokens, nothing copied; priced 30 tokens"


def test_a_fork_that_saves_more_than_it_copies_still_wins():
    """The same shape over a short history: the copy (176 rows) costs less than the 16 tokens
    it saves, so the most reuse wins, and the decision says what it copies."""
    short = list(range(1000, 1160))
    own = session(short + REPLY, prompt=160, exact=160, sid="s1")
    nxt = short + REPLY + [2, *range(300, 316)]
    earlier = session(nxt + [7, 8, 2], prompt=len(nxt) + 3, exact=len(nxt) + 3, sid="s2")
    decided = plan(view(nxt), [own, earlier], "exact", C)
    d = decided.decision
    assert d.render() == ("prefix: resumed (longest prefix with s2, 176 of 180; forked; "
                          "weighed token-prefix s1 at 160, prefix s2 at 176: most reuse)")
    assert decided.session is earlier and decided.fork
    assert (d.reused_tokens, d.primed_tokens, d.copied_rows, d.cost_tokens) == (176, 4, 176, 7)
    assert d.render_cost() == "cost: primed 4 tokens, copied 176 rows; priced 7 tokens"
