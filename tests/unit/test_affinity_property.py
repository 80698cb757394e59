"""Cache poisoning, as a property: whatever the histories, rewrites and claims, a resume
only ever reuses tokens the request itself has, at the same positions."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memrad.grid import find_anchors, is_cut
from memrad.request import Identity
from memrad.reuse.fingerprint import chain
from memrad.reuse.planner import RequestView, plan
from memrad.reuse.pool import Namespace, ParkedSession

OPEN = frozenset({1})
HEADER = (1, 2)  # a reply header's leading ids: prompts are also cut where it starts
C = 8
NAMES = st.one_of(st.none(), st.sampled_from(["a1", "b2", "c3"]))
NAMESPACES = st.sampled_from([Namespace("m", None), Namespace("m", "salt"), Namespace("other", None)])
TOKENS = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=60)


@st.composite
def parked_sessions(draw):
    sessions = []
    for i in range(draw(st.integers(min_value=0, max_value=5))):
        prompt = draw(TOKENS)
        reply = draw(st.lists(st.integers(min_value=2, max_value=6), max_size=10))
        tokens = tuple(prompt + reply)
        croppable = draw(st.booleans())
        exact_limit = draw(st.integers(min_value=0, max_value=len(prompt)))
        checkpoints = () if croppable else tuple(sorted(draw(st.sets(
            st.integers(min_value=1, max_value=len(tokens)), max_size=4)) | {len(tokens)}))
        name = draw(NAMES)
        sessions.append(ParkedSession(
            session_id=f"s{i}", namespace=draw(NAMESPACES),
            identity=None if name is None else Identity(name, draw(st.sampled_from(["session_id", "user"]))),
            token_ids=tokens, text="", prompt_checkpoint=len(prompt), checkpoints=checkpoints,
            croppable=croppable, exact_limit=exact_limit, fingerprint=chain(prompt, OPEN), num_bytes=1,
            created_at=0.0, last_used_at=float(i),
            anchors=tuple(a for a in find_anchors(prompt, HEADER) if a <= exact_limit)))
    return sessions


@st.composite
def requests(draw, sessions):
    """Either a fresh prompt, or a parked session's tokens rewritten the way clients do."""
    if sessions and draw(st.booleans()):
        base = list(draw(st.sampled_from(sessions)).token_ids)
        cut = draw(st.integers(min_value=0, max_value=len(base)))
        edit = draw(st.sampled_from(["truncate", "delete-span", "replace-one", "extend"]))
        if edit == "truncate":
            base = base[:cut]
        elif edit == "delete-span":
            base = base[:cut] + base[cut + draw(st.integers(min_value=1, max_value=8)):]
        elif edit == "replace-one" and base:
            base[min(cut, len(base) - 1)] = draw(st.integers(min_value=1, max_value=6))
        prompt = base + draw(st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=20))
    else:
        prompt = draw(TOKENS)
    name = draw(NAMES)
    identity = None if name is None else Identity(name, draw(st.sampled_from(["session_id", "user", "x-session-id"])))
    anchors = find_anchors(prompt, HEADER) if draw(st.booleans()) else None
    return RequestView("r", tuple(prompt), "", draw(NAMESPACES), identity, chain(prompt, OPEN), anchors)


@settings(max_examples=500, deadline=None)
@given(st.data(), parked_sessions(), st.sampled_from(["exact", "fast"]), st.booleans())
def test_every_resume_reuses_exactly_the_requests_own_leading_tokens(data, sessions, mode, affinity):
    view = data.draw(requests(sessions))
    decided = plan(view, sessions, mode, C, affinity)
    d = decided.decision
    assert d.reused_tokens + d.primed_tokens == len(view.prompt_ids)
    if d.outcome != "resumed":
        assert decided.session is None and d.reused_tokens == 0 and decided.checkpoint == 0
        return
    session, c = decided.session, decided.checkpoint
    assert 0 < c < len(view.prompt_ids), "a resume leaves a non-empty suffix to prime"
    assert view.prompt_ids[:c] == session.token_ids[:c], "reused tokens are the request's own"
    assert session.namespace == view.namespace
    # only a continuation of the same conversation replaces a session: same name, and the
    # request holds the session's whole prompt; anything else (a sibling of the name) forks
    same_name = (session.identity and session.identity.name) == (view.identity and view.identity.name)
    holds_prompt = view.prompt_ids[: session.prompt_checkpoint] == session.token_ids[: session.prompt_checkpoint]
    assert decided.fork == (not (same_name and holds_prompt))
    # the cheapest resume wins, and of those the most reuse: an offer reusing more tokens
    # lost only to a cheaper one (a fork whose copy costs more than it saves), and says so
    if d.won_by is not None:
        offers = [a for a in d.weighed if a.reused_tokens is not None]
        assert d.cost_tokens == min(a.cost_tokens for a in offers)
        assert d.reused_tokens == max(a.reused_tokens for a in offers if a.cost_tokens == d.cost_tokens)
        assert (d.won_by == "cheaper resume") == (d.reused_tokens < max(a.reused_tokens for a in offers))
    assert d.reused_tokens == c and d.candidate == session.session_id
    if mode == "exact":
        assert is_cut(c, C, session.anchors) and c <= session.exact_limit
        if view.anchors is not None:  # both prompts were cut alike below c
            assert is_cut(c, C, view.anchors)
            assert [a for a in view.anchors if a < c] == [a for a in session.anchors if a < c]
    if not session.croppable:
        assert c in session.checkpoints
