"""Speculation from the context changes how fast a reply decodes, never what it says.

A reply that copies its prompt (a scripted sampler standing in for a model that rewrites a
file) runs with speculate = auto and = off on the tiny models: every step's logits are the same
bits, and so are the tokens, text, finish reason, usage, logprobs and the state left parked;
the drafts were verified as rows of one step and most were accepted. The same holds where the
copy breaks off (rejected rows are cut back), at max_tokens, at a stop string, on a cancel, with
a grammar, under sampling with a seed, and for requests batched together. Where no step gives a
row the one-row step's bits (fp32 on the one-row step) speculation turns itself off and says so.
"""

import torch

from memrad.bench.draft_replay import replay
from memrad.chat.grammar import json_constraint
from memrad.engine.sampling import Shaper
from memrad.protocol import Speculation, TurnEvent, from_line, to_line
from memrad.request import GenerationRequest, SamplingParams
from stories import make_engine, recording, run_together

CHUNK = 16
FILE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"

JSON = '{"width": 3, "height": 4, "name": "width and height", "unit": "cm"}'


def prompt(engine, text=FILE):
    messages = [{"role": "system", "content": "You rewrite files."},
                {"role": "user", "content": f"Rename width to w:\n{text}"}]
    return engine.chat.render(messages, None)


def request(engine, rid, max_tokens=40, file=FILE, **sampling):
    text, ids = prompt(engine, file)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 2, **sampling})
    return GenerationRequest(rid, engine.model_id, tuple(ids), text, params)


def copying(engine, script):
    """The sampler of a model that copies: it answers `script` (or, None, `engine.script` as set
    when the request's first token is sampled) token by token (then argmax), recording every
    step's logits as `recording` does."""
    recording(engine)
    taken, scripts = {}, {}

    def sampler(scores, params, generator):
        engine.scores.setdefault(id(params), []).append(scores.clone())
        i = taken[id(params)] = taken.get(id(params), -1) + 1
        chosen = scripts.setdefault(id(params), script if script is not None else engine.script)
        return chosen[i] if i < len(chosen) else int(scores.argmax())

    engine.sampler = sampler
    return engine


def file_tokens(engine, file=FILE):
    """The file's tokens as they stand in the prompt, and where they start."""
    _, ids = prompt(engine, file)
    start = next(i for i in range(len(ids)) if engine.loaded.tokenizer.decode(ids[i:]).startswith(file[:8]))
    return list(ids), start


def outcome(result):
    completion, state, scores = result[:3]
    return (completion.text, completion.finish_reason, completion.prompt_tokens, completion.completion_tokens,
            completion.cached_tokens, completion.stop_sequence,
            tuple((lp.token, lp.logprob, lp.top) for lp in completion.logprobs or ()),
            state.generated_ids, state.cache_token_ids, state.cache.layers[0].get_seq_length(), scores.shape)


def both(loaded, make_requests, sampler=None, cancel_after=None, **flags):
    """The requests run with speculate = off and = auto on fresh engines: {arm: {rid: result}}."""
    out = {}
    for arm in ("off", "auto"):
        engine = make_engine(loaded, CHUNK, speculate=arm, **flags)
        engine = sampler(engine) if sampler is not None else recording(engine)
        out[arm] = {rid: (*result, engine) for rid, result in
                    run_together(engine, make_requests(engine), cancel_after=cancel_after).items()}
    return out


def assert_same(runs):
    for rid, plain in runs["off"].items():
        spec = runs["auto"][rid]
        assert outcome(spec) == outcome(plain), rid
        assert torch.equal(spec[2], plain[2]), rid  # every step's logits, bit for bit
        assert torch.equal(spec[1].prompt_logits, plain[1].prompt_logits)


def copy_then_break(engine, length=30, at=12):
    """A reply that copies `length` of the file's tokens, with one token changed at `at`."""
    ids, start = file_tokens(engine)
    script = ids[start : start + length]
    script[at] = ids[1]  # a rename: the draft after it is rejected, then the copy resumes
    return script


def test_a_copying_reply_is_plain_decodings_bits_with_most_drafts_accepted(q4_bf16):
    def sampler(engine):
        return copying(engine, copy_then_break(engine))

    runs = both(q4_bf16, lambda e: [request(e, "r")], sampler)
    assert_same(runs)
    spec = runs["auto"]["r"][0].speculation
    plain = runs["off"]["r"][0].speculation
    assert plain == Speculation(False, "speculate = off")
    assert spec.on and spec.reason == "on the eager step, up to 8 drafted"
    # 40 tokens, the first from the prompt's logits: 39 fed by 16 decode steps (the last is not fed);
    # drafting starts once the copy's last 3 tokens occur in the file and grows as the copy goes on;
    # the renamed token's draft is rejected, and the next waits for 3 tokens that match again
    assert (spec.fed_tokens, spec.decode_steps, spec.verify_steps) == (39, 16, 9)
    assert (spec.drafted_tokens, spec.accepted_tokens) == (32, 23)
    assert runs["auto"]["r"][3].runtime_choices["speculation"] == {  # `memrad status`
        "value": "auto", "reason": "drafts from the context verified as rows of the step each reply decodes on "
                                   "(memra.speculation says per reply); finished replies so far: 23 of 32 drafted "
                                   "tokens kept (72%), 2.44 tokens per decode step"}
    assert spec.fed_tokens == spec.accepted_tokens + spec.decode_steps
    assert "tokens per step" in spec.render() and spec.render().startswith("speculation: on (on the eager step")
    plain_state = runs["off"]["r"][1]  # `memrad bench draft-replay` finds the same drafts from the plain reply alone
    replayed = replay(list(plain_state.request.prompt_ids), list(plain_state.generated_ids), 8)
    assert (replayed["drafted"], replayed["kept"], replayed["verify_steps"], replayed["decode_steps"]) == (32, 23, 9, 16)


def test_max_tokens_a_stop_string_and_a_cancel_end_a_speculating_reply_where_they_end_a_plain_one(q4_bf16):
    def sampler(engine):
        return copying(engine, copy_then_break(engine, at=20))

    for max_tokens in (5, 9, 17):  # ends inside a verify step's accepted rows
        runs = both(q4_bf16, lambda e: [request(e, "r", max_tokens=max_tokens)], sampler)
        assert_same(runs)
        assert runs["auto"]["r"][0].completion_tokens == max_tokens
        assert runs["auto"]["r"][0].finish_reason == "length"
    runs = both(q4_bf16, lambda e: [request(e, "r", stop=("height):",))], sampler)
    assert_same(runs)
    assert runs["auto"]["r"][0].finish_reason == "stop" and runs["auto"]["r"][0].stop_sequence == "height):"
    runs = both(q4_bf16, lambda e: [request(e, "r")], sampler, cancel_after={"r": 11})
    assert_same(runs)
    assert runs["auto"]["r"][0].finish_reason == "cancelled"


def test_greedy_replies_with_a_grammar_and_sampled_ones_with_a_seed_are_unchanged(q4_bf16):
    runs = both(q4_bf16, lambda e: [request(e, "free")])
    assert_same(runs)
    assert runs["auto"]["free"][0].speculation.verify_steps > 0  # drafts were tried on the model's own reply

    def json_copy(engine):  # copies the JSON in its prompt, through the grammar's mask
        ids, start = file_tokens(engine, JSON)
        return copying(engine, ids[start : start + 30])

    runs = both(q4_bf16, lambda e: [request(e, "json", file=JSON, constraint=json_constraint(None, "response_format"))],
                json_copy)
    assert_same(runs)
    assert runs["auto"]["json"][0].speculation.accepted_tokens > 10
    sampled = {}
    for arm in ("off", "auto"):
        engine = make_engine(q4_bf16, CHUNK, speculate=arm)
        completion = engine.generate(request(engine, "s", temperature=0.2, seed=7), lambda _: None, lambda: False)
        sampled[arm] = (completion.text, [lp.logprob for lp in completion.logprobs], completion.speculation)
    assert sampled["auto"][:2] == sampled["off"][:2]
    assert sampled["auto"][2].verify_steps > 0


def test_a_draft_the_grammar_refuses_is_cut_before_it_takes_a_row(q4_bf16, monkeypatch):
    # The prompt's JSON says "width" and "height"; the schema allows only "w" and "h": a reply that
    # copies its prompt wherever the mask lets it is drafted "width": 3, ... which the mask refuses.
    schema = {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
              "required": ["w", "h"]}

    def through_the_mask(engine):  # copies the prompt's JSON token by token where the mask allows it
        ids, start = file_tokens(engine, JSON)
        script = ids[start : start + 30]
        recording(engine)

        def sampler(scores, params, generator):
            steps = engine.scores.setdefault(id(params), [])
            steps.append(scores.clone())
            i = len(steps) - 1
            return script[i] if i < len(script) and torch.isfinite(scores[script[i]]) else int(scores.argmax())

        engine.sampler = sampler
        return engine

    def requests(engine):
        return [request(engine, "json", file=JSON, constraint=json_constraint(schema, "response_format"))]

    runs = both(q4_bf16, requests, through_the_mask)
    assert_same(runs)  # every step's logits, the tokens, logprobs, finish and usage: plain decoding's
    checked = runs["auto"]["json"][0].speculation
    monkeypatch.setattr(Shaper, "allows", lambda self, tokens: len(tokens))  # as before: verified, then rejected
    unchecked = both(q4_bf16, requests, through_the_mask)
    assert_same(unchecked)
    before = unchecked["auto"]["json"][0].speculation

    def rows(spec):  # each decode step runs its pending token's row and one per drafted token
        return spec.decode_steps + spec.drafted_tokens

    reply = '{"w": 88883, "h": 8888444444444444444444'  # the tiny model's digits, until max_tokens
    assert runs["auto"]["json"][0].text == unchecked["auto"]["json"][0].text == reply
    # 40 tokens in 27 decode steps either way: refused drafts cut, 42 rows (12 of 15 drafted kept)
    # against 49 (12 of 22)
    assert (checked.drafted_tokens, checked.accepted_tokens, checked.decode_steps, rows(checked)) == (15, 12, 27, 42)
    assert (before.drafted_tokens, before.accepted_tokens, before.decode_steps, rows(before)) == (22, 12, 27, 49)


def test_requests_batched_together_speculate_each_on_its_own_rows(tiny_loaded):
    # fp32: a row's bits depend on M, so each flight verifies on the padded 4-row step it decodes on
    def sampler(engine):
        ids, start = file_tokens(engine)
        return copying(engine, ids[start : start + 30])

    runs = both(tiny_loaded, lambda e: [request(e, "a"), request(e, "b", max_tokens=13), request(e, "c", max_tokens=7)],
                sampler, max_batch=4)
    assert_same(runs)
    for rid in "abc":
        spec = runs["auto"][rid][0].speculation
        assert spec.reason == "on the eager batched step of 8 rows, up to 7 drafted in the rows its neighbours leave"
        assert spec.accepted_tokens > 0, rid


def test_with_speculation_on_the_batched_step_has_a_run_s_rows_beside_max_batch_s(q4_bf16):
    # max_batch 4 requests together, and one request's run of up to 8 rows (its pending token, 7
    # drafts) on the 8-row twin; off: the 2- and 4-row steps only
    sizes = {arm: make_engine(q4_bf16, CHUNK, speculate=arm, max_batch=4).decoder.batch_sizes for arm in ("off", "auto")}
    assert sizes == {"off": (2, 4), "auto": (2, 4, 8)}

    def sampler(engine):
        ids, start = file_tokens(engine)
        return copying(engine, ids[start : start + 30])

    runs = both(q4_bf16, lambda e: [request(e, "r", max_tokens=30)], sampler, max_batch=4)
    assert_same(runs)
    spec = runs["auto"]["r"][0].speculation
    assert spec.reason == "on the eager batched step of 8 rows, up to 7 drafted in the rows its neighbours leave"
    # the whole reply copies the file: a verify step feeds up to 8 tokens, where the 4-row step fed 4
    assert spec.tokens_per_step > 4, spec


def test_where_no_step_gives_a_row_the_one_row_steps_bits_speculation_turns_off_and_says_so(tiny_loaded):
    def sampler(engine):
        ids, start = file_tokens(engine)
        return copying(engine, ids[start : start + 30])

    runs = both(tiny_loaded, lambda e: [request(e, "r")], sampler)  # fp32, the one-row step: M matters
    assert_same(runs)
    spec = runs["auto"]["r"][0].speculation
    assert (spec.drafted_tokens, spec.verify_steps) == (0, 0)
    assert spec.reason == ("on the eager step, up to 8 drafted; then off: no multi-row step of 4 rows has "
                           "the one-row step's bits here")


def test_the_figures_cross_the_control_socket():
    spec = Speculation(True, "on the eager step, up to 8 drafted", 40, 30, 6, 12, 42)
    assert (spec.acceptance, spec.tokens_per_step) == (0.75, 3.5)
    event = TurnEvent(0.0, "r", None, None, 10, 0, 43, 0.1, "cold", "length", 1.0, speculation=spec)
    assert from_line(to_line(event)) == event
    assert spec.render() == ("speculation: on (on the eager step, up to 8 drafted; accepted 30 of 40 drafted (75%) "
                             "in 6 verify steps; 3.50 tokens per step)")


def test_speculation_asks_for_the_batched_packages_at_admission(q4_bf16, monkeypatch):
    # its runs ride the compiled batched step: a lone agent's first request wants them built
    for arm, wanted in (("off", 0), ("auto", 1)):
        engine = make_engine(q4_bf16, CHUNK, speculate=arm, max_batch=4, compile="auto")
        calls = []
        monkeypatch.setattr(engine.decoder, "want_batch", lambda: calls.append(1))
        flight = engine.admit(request(engine, "r"), lambda _: None, lambda: False)
        assert len(calls) == wanted and flight.feed.step == "eager"
