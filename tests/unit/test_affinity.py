"""Identity nominates, bytes decide: affinity stories over hand-built sessions (no model).

Token id 1 opens a message (as <|im_start|> does in ChatML); 2 closes one.
"""

import dataclasses

from memrad.request import Identity
from memrad.reuse.fingerprint import chain
from memrad.reuse.planner import RequestView, plan
from memrad.reuse.pool import Namespace, ParkedSession

NS = Namespace("m", None)
OPEN = frozenset({1})
C = 16


def msg(role, *content):
    return [1, role, *content, 2, 10]


SYSTEM = msg(50, *range(100, 140))           # 44 tokens
USER1 = msg(51, *range(200, 220))
REPLY1 = [*range(300, 330)]                 # the reply as generated (with a <think> part)
REPLY1_STRIPPED = [*range(300, 305), *range(322, 330)]
USER2 = msg(51, *range(400, 410))
GEN = [1, 52, 10]                           # the generation prompt: "<|im_start|>assistant\n"


def park(prompt, reply, sid="s1", identity=None, **extra):
    tokens = tuple(prompt + reply)
    fields = dict(session_id=sid, namespace=NS, identity=identity, token_ids=tokens, text="",
                  prompt_checkpoint=len(prompt), checkpoints=(), croppable=True,
                  exact_limit=len(prompt) - len(prompt) % C, fingerprint=chain(prompt, OPEN),
                  num_bytes=1, created_at=0.0, last_used_at=0.0)
    fields.update(extra)
    return ParkedSession(**fields)


def ask(prompt, identity=None):
    return RequestView("r", tuple(prompt), "", NS, identity, chain(prompt, OPEN))


TURN2 = SYSTEM + USER1 + GEN
TURN3 = SYSTEM + USER1 + [1, 52, 10, *REPLY1_STRIPPED, 2, 10] + USER2 + GEN  # 5 segments
REPLY3 = [*range(500, 530)]
# turn 4: the client sends reply 3 back with its last 10 tokens trimmed
TURN4 = TURN3 + REPLY3[:20] + [2, 10] + msg(51, 600, 601) + GEN


def test_the_bar_of_three_segments():
    # turn 2's prompt shares system + user1 with turn 1's: 2 < 3, no nomination
    parked = park(TURN2, REPLY1)
    d = plan(ask(TURN3), [parked], "fast", C, longest_prefix=False).decision
    assert d.render() == "cold (no nomination: 2 shared segments < 3)"
    assert d.shared_segments == 2
    # the longest-prefix tier needs no nomination: turn 3 contains turn 2's whole prompt, so
    # it continues that conversation and replaces its session
    lcp = len(TURN2) + 5  # the stripped reply keeps its first 5 tokens
    p = plan(ask(TURN3), [parked], "fast", C)
    assert p.decision.render() == f"prefix: resumed (longest prefix with s1, {lcp} of {len(TURN3)}; replaces it)"
    assert (p.fork, p.checkpoint, p.decision.divergence, p.decision.shared_segments) == (False, lcp, lcp, 2)
    # one turn later the chain shares system, user1, reply1, user2: nominated. Fast mode reuses
    # the prompt and the untouched start of the reply (up to where the trim diverges).
    parked3 = park(TURN3, REPLY3)
    d4 = plan(ask(TURN4), [parked3], "fast", C).decision
    diverged = len(TURN3) + 20
    assert d4.render() == (f"affinity: resumed (implicit, 4 shared segments; history diverged at {diverged} "
                           f"of checkpoint {len(TURN3) + 30}; resumed from {diverged}; "
                           f"primed {len(TURN4) - diverged})")
    assert (d4.nomination, d4.source, d4.shared_segments, d4.divergence) == ("implicit", None, 4, diverged)


def test_exact_mode_resumes_at_the_grid_below_the_previous_prompt():
    d = plan(ask(TURN4), [park(TURN3, REPLY3)], "exact", C).decision
    floor = len(TURN3) - len(TURN3) % C
    assert d.render() == f"affinity: resumed (implicit, 4 shared segments; checkpoint {floor}; " \
                         f"primed {len(TURN4) - floor})"
    assert d.reused_tokens + d.primed_tokens == len(TURN4)


def test_a_named_client_resumes_from_turn_two():
    alice = Identity("a1", "session_id")
    parked = park(TURN2, REPLY1, identity=alice)
    d = plan(ask(TURN3, alice), [parked], "fast", C).decision
    lcp = len(TURN2) + 5  # the stripped reply keeps its first 5 tokens
    assert d.render() == (f'affinity: resumed (explicit, session_id "a1", 2 shared segments; history diverged '
                          f"at {lcp} of checkpoint {len(TURN2) + 30}; resumed from {lcp}; "
                          f"primed {len(TURN3) - lcp})")
    assert (d.nomination, d.source, d.divergence) == ("explicit", "session_id", lcp)


VICTIM = SYSTEM + msg(51, *range(700, 760)) + GEN        # 111 tokens: exact up to 96


def test_a_false_claim_never_resumes_foreign_state():
    """A name is a set of conversations: a claimed name whose sessions share nothing
    resumable and fewer than 3 segments is a sibling (or a liar), not a decline."""
    victim = park(VICTIM, [*range(800, 820)], identity=Identity("a1", "user"))
    attacker = msg(50, *range(900, 940)) + msg(51, *range(900, 960)) + GEN  # other system prompt too
    d = plan(ask(attacker, Identity("a1", "x-session-id")), [victim], "exact", C).decision
    assert d.render() == ('cold (no nomination: no parked session named "a1" shares a resumable prefix '
                          "or 3 segments (1 under that name))")
    assert (d.outcome, d.reused_tokens, d.candidate, d.reason_class) == ("cold", 0, None, "below-bar")


def test_a_claim_of_the_requests_own_rewritten_conversation_is_declined_with_its_divergence():
    """3 shared segments mark the request's own conversation: below every checkpoint it is
    declined, and the decline says where the history diverged."""
    alice = Identity("a1", "session_id")
    parked = park(TURN3, REPLY3, identity=alice)
    # the client re-rendered one word inside the system prompt (its edges unchanged), below
    # the first grid cut
    rewritten = TURN3[:10] + [99] + TURN3[11:] + REPLY3 + [2, 10] + USER2 + GEN
    d = plan(ask(rewritten, alice), [parked], "exact", C).decision
    floor = len(TURN3) - len(TURN3) % C
    assert d.render() == f"affinity: declined (history diverged at 10 of checkpoint {floor})"
    assert (d.outcome, d.candidate, d.nomination, d.shared_segments, d.divergence) == (
        "declined", "s1", "explicit", 4, 10)


def test_a_claim_resumes_only_the_tokens_it_really_shares():
    victim = park(VICTIM, [*range(800, 820)], identity=Identity("a1", "user"))
    attacker = SYSTEM + msg(51, *range(900, 960)) + GEN  # same system prompt, other question
    d = plan(ask(attacker, Identity("a1", "user")), [victim], "exact", C).decision
    assert d.render() == (f'affinity: resumed (explicit, user "a1", 1 shared segments; history diverged at 46 '
                          f"of checkpoint 96; resumed from 32; primed {len(attacker) - 32}; forked)")
    assert tuple(attacker[:32]) == victim.token_ids[:32]


def test_named_and_unnamed_never_cross():
    unnamed = park(TURN3, REPLY3)
    turn4 = TURN4
    d = plan(ask(turn4, Identity("a1", "session_id")), [unnamed], "fast", C, longest_prefix=False).decision
    assert d.render() == 'affinity: declined (named "a1" vs unnamed parked session)'
    named = dataclasses.replace(unnamed, identity=Identity("b2", "user"))
    d = plan(ask(turn4), [named], "fast", C, longest_prefix=False).decision
    # Another conversation's name never reaches a client that did not send it.
    assert d.render() == 'affinity: declined (unnamed request vs another named session)'
    d = plan(ask(turn4, Identity("a1", "user")), [named], "fast", C, longest_prefix=False).decision
    assert d.render() == 'affinity: declined (named "a1" vs another named session)'
    # the bytes alone may still share: a fork, never a replacement, across names
    forked = plan(ask(turn4, Identity("a1", "user")), [named], "fast", C)
    shared = len(TURN3) + 20
    assert forked.fork and forked.decision.render() == (
        f'prefix: resumed (longest prefix with s1, {shared} of {len(TURN4)}; forked; '
        f'affinity: declined (named "a1" vs another named session))')


def test_a_name_in_a_decision_is_one_printable_line_of_bounded_length():
    unnamed = park(TURN3, REPLY3)
    head = "x\nERROR memrad.security: SECURITY: FAKE LINE\x1b[2J"
    forged = head + "y" * 1000
    d = plan(ask(TURN4, Identity(forged, "session_id")), [unnamed], "fast", C, longest_prefix=False).decision
    assert d.render() == ('affinity: declined (named "x\\nERROR memrad.security: SECURITY: FAKE LINE\\x1b[2J'
                          + "y" * (200 - len(head)) + '...(1048 chars)" vs unnamed parked session)')


def test_named_requests_ignore_prefix_matches_of_other_names():
    parked = park(TURN2, REPLY1, identity=Identity("b2", "user"))
    extended = TURN2 + REPLY1 + [2, 10] + USER2 + GEN
    d = plan(ask(extended, Identity("a1", "user")), [parked], "fast", C, longest_prefix=False).decision
    assert d.render() == 'cold (no nomination: no parked session named "a1")'
    forked = plan(ask(extended, Identity("a1", "user")), [parked], "fast", C)
    assert forked.fork and forked.decision.tier == "prefix" and forked.checkpoint == len(TURN2) + 30
    same = plan(ask(extended, Identity("b2", "session_id")), [parked], "fast", C).decision
    assert same.render() == (f"token-prefix: resumed (session s1; checkpoint {len(TURN2) + 30}; "
                             f"primed {len(extended) - len(TURN2) - 30})")


def test_two_fresh_conversations_sharing_only_the_system_prompt_are_not_linked():
    other = park(SYSTEM + msg(51, *range(700, 720)) + GEN, [*range(800, 810)])
    fresh = SYSTEM + USER1 + GEN
    d = plan(ask(fresh), [other], "fast", C, longest_prefix=False).decision
    assert d.render() == "cold (no nomination: 1 shared segments < 3)"
    # not linked as one conversation, but the shared system prompt is reused by a fork
    forked = plan(ask(fresh), [other], "fast", C)
    assert forked.fork and forked.decision.render() == (
        f"prefix: resumed (longest prefix with s1, {len(SYSTEM) + 2} of {len(fresh)}; forked)")


def test_affinity_off_keeps_the_prefix_tiers():
    parked3 = park(TURN3, REPLY3)
    assert plan(ask(TURN4), [parked3], "fast", C, affinity=False, longest_prefix=False).decision.outcome == "cold"
    extended = TURN3 + REPLY3 + [2, 10]
    assert plan(ask(extended), [parked3], "fast", C, affinity=False).decision.tier == "token-prefix"


SUB_SYSTEM = msg(53, *range(1000, 1040))     # a sub-agent's own system prompt: 44 tokens
SUB_TASK = msg(51, *range(1100, 1130))


def test_a_name_is_a_set_the_bytes_pick_among_its_sessions():
    """One name, a main agent and a sub-agent parked: each request resumes its own
    conversation, whichever is more recent, and only its own is replaced."""
    name = Identity("claude-1", "metadata.user_id")
    main = park(TURN3, REPLY3, identity=name, last_used_at=1.0)
    sub_prompt = SUB_SYSTEM + SUB_TASK + GEN
    sub = park(sub_prompt, [*range(1200, 1210)], sid="s2", identity=name, last_used_at=2.0)
    main_turn = plan(ask(TURN4, name), [main, sub], "exact", C, longest_prefix=False)
    floor = len(TURN3) - len(TURN3) % C
    assert main_turn.decision.render() == (f'affinity: resumed (explicit, metadata.user_id "claude-1", 4 shared '
                                           f"segments; checkpoint {floor}; primed {len(TURN4) - floor})")
    assert (main_turn.session.session_id, main_turn.fork) == ("s1", False)
    sub_turn = sub_prompt + [*range(1200, 1205)] + [2, 10] + msg(51, 1300) + GEN
    decided = plan(ask(sub_turn, name), [main, sub], "exact", C, longest_prefix=False)
    sub_floor = len(sub_prompt) - len(sub_prompt) % C
    assert decided.decision.render() == (f'affinity: resumed (explicit, metadata.user_id "claude-1", 2 shared '
                                         f"segments; checkpoint {sub_floor}; primed {len(sub_turn) - sub_floor})")
    assert (decided.session.session_id, decided.fork) == ("s2", False)


def test_a_sibling_under_the_name_forks_and_never_replaces():
    """A second sub-agent shares the first one's system prompt: it reuses those tokens by a
    fork and leaves its sibling parked, with no decline."""
    name = Identity("claude-1", "metadata.user_id")
    sub = park(SUB_SYSTEM + SUB_TASK + GEN, [*range(1200, 1210)], identity=name)
    sibling = SUB_SYSTEM + msg(51, *range(1400, 1430)) + GEN
    decided = plan(ask(sibling, name), [sub], "exact", C, longest_prefix=False)
    assert decided.decision.render() == (f'affinity: resumed (explicit, metadata.user_id "claude-1", 1 shared '
                                         f"segments; history diverged at 46 of checkpoint 80; resumed from 32; "
                                         f"primed {len(sibling) - 32}; forked)")
    assert decided.fork and decided.session is sub
    # a side query with its own system prompt shares nothing resumable: cold, not declined
    side = msg(50, *range(1500, 1540)) + msg(51, 1600) + GEN
    d = plan(ask(side, name), [sub], "exact", C, longest_prefix=False).decision
    assert d.render() == ('cold (no nomination: no parked session named "claude-1" shares a resumable prefix '
                          "or 3 segments (1 under that name))")


def test_the_most_reuse_wins_over_the_nomination():
    """Affinity nominates the name's own session, but an unnamed session holds more of the
    same bytes: the longest exact prefix wins (a fork), and the reason says what was weighed."""
    name = Identity("a1", "session_id")
    own = park(SYSTEM + msg(51, *range(700, 760)) + GEN, [*range(800, 820)], identity=name, last_used_at=2.0)
    other = park(TURN3, REPLY3, sid="s2")
    decided = plan(ask(TURN4, name), [own, other], "exact", C)
    floor = len(TURN3) - len(TURN3) % C
    assert decided.decision.render() == (
        f"prefix: resumed (longest prefix with s2, {floor} of {len(TURN4)}; forked; "
        f"weighed affinity s1 at 32, prefix s2 at {floor}: most reuse)")
    assert decided.fork and decided.session is other and decided.checkpoint == floor
    d = decided.decision
    assert (d.won_by, [(a.tier, a.candidate, a.reused_tokens) for a in d.weighed]) == (
        "most reuse", [("affinity", "s1", 32), ("prefix", "s2", floor)])
    # the longest-prefix tier off (the A/B arm): the nomination alone decides
    alone = plan(ask(TURN4, name), [own, other], "exact", C, longest_prefix=False).decision
    assert (alone.tier, alone.reused_tokens, alone.weighed, alone.won_by) == ("affinity", 32, (), None)
