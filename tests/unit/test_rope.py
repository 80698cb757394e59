"""RoPE per conversation: native where prompt + reply fits the model's window, YaRN past it.

A tiny llama configured for 64 positions is served at 256 (yarn x4). A request whose prompt +
max_tokens fits 64 runs under the native rope and gets, bit for bit, what the same model
served at its native 64 gives; one that needs more runs under yarn from its first token. A
conversation that grows past 64 is declined its native parked state ("rescaled") and
re-prefilled under yarn once; each rope's resumed turn equals its cold run, in memory and
after a restart from the disk tier, whose files record the rope they were computed under.
"""

import pytest
import torch

import stories
from memrad.engine.model.context import ServedContext
from memrad.engine.model.loader import load_model
from memrad.engine.model.rope import RopeRule, Scaling, rule_for
from memrad.engine.state.disk import DiskTier, state_format
from memrad.request import GenerationRequest, SamplingParams

NATIVE, SERVED, CHUNK = 64, 256, 16
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # 35 tokens


def test_the_rule_runs_native_while_prompt_and_reply_fit_the_native_window():
    rule = RopeRule(ServedContext(32768, 8192, "yarn", 4.0), True)
    assert rule.choose(30, 4096) == Scaling("native", "4,126 tokens (prompt 30 + reply 4,096) fit the native 8,192")
    assert rule.choose(4096, 4096).native  # exactly the window
    assert rule.choose(4205, 4096) == Scaling("yarn x4", "8,301 tokens (prompt 4,205 + reply 4,096) > native 8,192")
    assert rule.choose(20_000, 256).name == "yarn x4"  # an agent CLI's first request: scaled from token 0
    assert rule.describe() == "native to 8,192, yarn x4 to 32,768"
    assert rule.reason().startswith("32,768 tokens served: a request whose prompt + max_tokens fits the native 8,192 "
                                    "runs at the model's native RoPE")
    within = rule_for(ServedContext(8192, 8192, "native", 1.0), None, True, "")  # --context 8192: never scale
    assert within.choose(30, 8000) == Scaling("native", "served within the native length")
    one_table = rule_for(ServedContext(32768, 8192, "yarn", 4.0), object(), False, "the GemmaStep decode step has "
                                                                                    "one rope table")
    assert one_table.choose(30, 100) == Scaling("yarn x4", "every request runs scaled: the GemmaStep decode step has "
                                                            "one rope table")


@pytest.fixture(scope="module")
def short(tiny_dir):
    """The tiny llama of native 64 loaded at each served length: {64: native, 128: yarn x2, 256: yarn x4}."""
    torch.set_num_threads(1)
    return {n: load_model(str(tiny_dir("llama-short")), device="cpu", dtype="float32", context=n)
            for n in (NATIVE, 2 * NATIVE, SERVED)}


def request(engine, messages, rid, max_tokens, salt=None):
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)


def test_a_request_that_fits_gets_the_native_models_bits_and_one_that_does_not_runs_yarn(short):
    torch.set_num_threads(1)
    served, native = short[SERVED], short[NATIVE]
    scaled, unscaled = stories.recording(stories.make_engine(served, CHUNK)), stories.recording(
        stories.make_engine(native, CHUNK))
    assert scaled.runtime_choices["context"]["value"] == "native to 64, yarn x4 to 256"
    fits = {e: e.generate(request(e, FRANCE, "q", 6), lambda _: None, lambda: False) for e in (scaled, unscaled)}
    assert fits[scaled].prompt_tokens + 6 <= NATIVE and fits[scaled].decision.rope == "native"
    (ours,), (theirs,) = scaled.scores.values(), unscaled.scores.values()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and len(ours) == len(theirs) == 6
    assert fits[scaled].text == fits[unscaled].text
    # 35 + 40 > 64: the same question under yarn from its first token, and that changes the logits
    longer = scaled.generate(request(scaled, FRANCE, "long", 40, salt="x"), lambda _: None, lambda: False)
    assert longer.decision.rope == "yarn x4"
    assert not torch.equal(scaled.finished[-1].prompt_logits, scaled.finished[0].prompt_logits)


def test_a_batch_holds_requests_of_both_ropes_each_with_its_own_bits(short):
    torch.set_num_threads(1)
    served, native = short[SERVED], short[NATIVE]
    spain = [{"role": "user", "content": "And the capital of Spain?"}]
    scaled = stories.recording(stories.make_engine(served, CHUNK, max_batch=4, pool=False))
    unscaled = stories.recording(stories.make_engine(native, CHUNK, max_batch=4, pool=False))
    mixed = stories.run_together(scaled, [request(scaled, FRANCE, "fr", 6), request(scaled, spain, "es", 6),
                                          request(scaled, FRANCE, "fr-yarn", 30)])
    assert [mixed[r][0].decision.rope for r in ("fr", "es", "fr-yarn")] == ["native", "native", "yarn x4"]
    alone = stories.run_together(unscaled, [request(unscaled, FRANCE, "fr", 6), request(unscaled, spain, "es", 6)])
    for rid in ("fr", "es"):  # the native rows decode as the native model's batch does
        assert torch.equal(mixed[rid][2], alone[rid][2]), rid
    yarn_alone = stories.run_together(stories.recording(stories.make_engine(served, CHUNK, max_batch=4, pool=False)),
                                      [request(scaled, FRANCE, "fr-yarn", 30)])
    assert torch.equal(mixed["fr-yarn"][2], yarn_alone["fr-yarn"][2])  # its own batch: the same bits alone


def converse(engine, salt=None):
    """Four turns: two that fit the native 64 (the second resumes the first), one past it
    (rescaled: declined its native parked state), one more past it (resumes the rescaled turn)."""
    messages, out = list(FRANCE), []
    for rid, then in (("t1", "ok"), ("t2", "And Spain, and then Portugal? One word each."), ("t3", "Thanks."),
                      ("t4", None)):
        completion, state = stories.ask(engine, messages, rid, salt=salt, max_tokens=4)
        out.append((completion, state))
        if then is not None:
            messages = messages + [{"role": "assistant", "content": completion.text}, {"role": "user", "content": then}]
    return out, messages


def test_a_conversation_that_grows_past_the_native_length_is_rescaled_once_and_resumes_under_each_rope(short):
    torch.set_num_threads(1)
    served = short[SERVED]
    engine = stories.make_engine(served, CHUNK)
    turns, _ = converse(engine)
    (t1, _), (t2, s2), (t3, s3), (t4, s4) = turns
    assert [t.decision.rope for t, _ in turns] == ["native", "native", "yarn x4", "yarn x4"]
    assert t2.decision.outcome == "resumed" and t2.cached_tokens == t1.prompt_tokens
    d3 = t3.decision
    assert t2.prompt_tokens + 4 <= NATIVE < t3.prompt_tokens + 4
    assert (d3.outcome, d3.reason_class, d3.candidate, t3.cached_tokens) == ("declined", "rescaled",
                                                                             s2.session.session_id, 0)
    assert d3.reason == (f"rescaled: {t3.prompt_tokens + 4} tokens (prompt {t3.prompt_tokens} + reply 4) > native 64; "
                         f"{s2.session.session_id} was primed under the native rope, {t2.prompt_tokens} tokens not "
                         "reused")
    assert d3.render().startswith(f"{d3.tier}: declined (rescaled: ")
    assert t4.decision.outcome == "resumed" and t4.decision.candidate == s3.session.session_id
    assert (s2.session.rope, s3.session.rope, s4.session.rope) == ("native", "yarn x4", "yarn x4")
    cold, _ = converse(stories.make_engine(served, CHUNK, pool=False))
    for (warm, warm_state), (cold_turn, cold_state) in zip(turns, cold):  # resumed == cold under each rope
        assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold_turn.text


def test_session_files_record_the_rope_and_a_restart_resumes_under_each(short, tmp_path):
    torch.set_num_threads(1)
    served, native = short[SERVED], short[NATIVE]

    def restarted(loaded):
        return stories.make_engine(loaded, CHUNK, disk=DiskTier(tmp_path, 10**9, state_format(loaded, CHUNK, "exact"),
                                                              loaded.rope_keys))

    before = restarted(served)
    turns, messages = converse(before)
    before.close()
    after = restarted(served)
    on_disk = {s.session_id: s.rope for s in after.parking.disk.pool.sessions()}
    assert sorted(on_disk.values()) == ["native", "yarn x4"]  # t2's and t4's sessions (t1, t3 were replaced)
    # A yarn file's key is the one memrad wrote before ropes were per conversation: it loads as yarn.
    assert after.parking.disk.ropes["yarn x4"] == state_format(served, CHUNK, "exact")["rope"]
    # A tier told nothing of the ropes never files a session under a rope it was not computed under.
    served_key = state_format(served, CHUNK, "exact")["rope"]
    assert DiskTier(tmp_path / "told-nothing", 10**9, state_format(served, CHUNK, "exact")).ropes == {
        f"unnamed scaled rope {served_key}": served_key}
    native_file = next(sid for sid, rope in on_disk.items() if rope == "native")
    # ... and a native file is what the model served at its native length writes: it loads there too.
    assert restarted(native).parking.disk.pool.get(native_file).rope == "native"
    x2 = restarted(short[2 * NATIVE])
    assert {s.rope for s in x2.parking.disk.pool.sessions()} == {"native"} and len(x2.parking.disk.foreign) == 1
    (_, s2), (t3, _), (t4, s4) = turns[1], turns[2], turns[3]
    fits = messages[:2] + [{"role": "user", "content": "no"}]  # t2's history rewritten: native, forks t2's file
    past = messages + [{"role": "assistant", "content": t4.text}, {"role": "user", "content": "Bye."}]
    for history, rope, parent in ((fits, "native", s2), (past, "yarn x4", s4)):
        warm, warm_state = stories.ask(after, history, f"{rope}-warm", max_tokens=4)
        cold, cold_state = stories.ask(after, history, f"{rope}-cold", salt="cold", max_tokens=4)
        assert (warm.decision.outcome, warm.decision.rope, warm.decision.candidate) == ("resumed", rope,
                                                                                        parent.session.session_id)
        assert warm.cached_tokens == warm.decision.checkpoint > 0 and cold.cached_tokens == 0
        assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold.text

