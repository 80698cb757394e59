"""Grammars (memrad.chat.grammar) and the engine's constrained decoding on a tiny model."""

import json

import pytest
import torch

from memrad.chat.format import chat_format
from memrad.chat.grammar import Grammars, call_grammar, json_constraint
from memrad.engine.sampling import Shaper
from memrad.request import Constraint, GenerationRequest, SamplingParams
from stories import make_engine
from tiny import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
CHOICE = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def accepts(grammars, tokenizer, constraint, text):
    """Whether the grammar takes `text` whole and may end there."""
    matcher = grammars.matcher(constraint)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_a_json_schema_takes_valid_objects_in_one_whitespace_spelling_only(grammars, tokenizer):
    schema = json_constraint(TOOLS[1]["function"]["parameters"], "response_format")
    assert schema.kind == "json_schema" and grammars.error(schema) is None
    assert accepts(grammars, tokenizer, schema, '{"a": 1, "b": -2}')
    assert not accepts(grammars, tokenizer, schema, '{"a":1,"b":-2}')  # json.dumps's separators only
    assert not accepts(grammars, tokenizer, schema, '{"a": 1, "b": 2, "c": 3}')
    assert not accepts(grammars, tokenizer, schema, '{"a": "1", "b": 2}')
    anything = json_constraint(None, "response_format")
    assert anything.kind == "json_object"
    assert accepts(grammars, tokenizer, anything, '{"x": [1, {"y": null}]}')
    assert not accepts(grammars, tokenizer, anything, '[1]')


def test_a_schema_that_does_not_compile_says_why(grammars):
    assert "Invalid type: nope" in grammars.error(json_constraint({"type": "nope"}, "response_format"))
    assert "look-around" in grammars.error(json_constraint({"type": "string", "pattern": "(?<=x)a"}, "r"))


def test_compiled_grammars_are_cached_by_text_and_each_request_gets_a_fresh_matcher(grammars, tokenizer):
    constraint = json_constraint(CHOICE, "response_format")
    first = grammars.matcher(constraint)
    assert first.consume_tokens(tokenizer.encode('{"answer": "yes"}', add_special_tokens=False))
    assert grammars._compile(constraint.grammar) is grammars._compile(json_constraint(CHOICE, "other").grammar)
    assert not grammars.matcher(constraint).is_accepting()  # the cached one was not advanced


@pytest.mark.parametrize(("mode", "name", "text"), [
    ("function", "add", '{"a": 1, "b": 2}}\n</tool_call>'),
    ("required", None, 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("auto", None, 'Adding. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("auto", None, "no call at all"),
])
def test_tool_grammars_take_calls_of_the_given_tools(grammars, tokenizer, mode, name, text):
    fmt = chat_format(tokenizer)
    constraint = grammars.tool_constraint(fmt, TOOLS, mode, name, parallel=True)
    assert constraint.kind == "tool_call" and grammars.error(constraint) is None
    assert accepts(grammars, tokenizer, constraint, text)


@pytest.mark.parametrize(("mode", "name", "text"), [
    ("function", "add", '{"a": 1, "b": "2"}}\n</tool_call>'),  # arguments off the schema
    ("function", "add", '{"city": "Oslo"}}\n</tool_call>'),  # another tool's arguments
    ("required", None, '2 + 3", "arguments": {}}\n</tool_call>'),  # a name not among the tools
    ("auto", None, 'Sure <tool_call>\n{"name": "2 + 3", "arguments": {}}\n</tool_call>'),
])
def test_tool_grammars_refuse_names_and_arguments_the_tools_do_not_have(grammars, tokenizer, mode, name, text):
    constraint = grammars.tool_constraint(chat_format(tokenizer), TOOLS, mode, name, parallel=True)
    assert not accepts(grammars, tokenizer, constraint, text)


def test_parallel_calls_follow_the_template_s_newline_and_only_when_allowed(grammars, tokenizer):
    fmt = chat_format(tokenizer)
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert accepts(grammars, tokenizer, grammars.tool_constraint(fmt, TOOLS, "auto", None, True), two)
    assert not accepts(grammars, tokenizer, grammars.tool_constraint(fmt, TOOLS, "auto", None, False), two)


def test_a_tool_schema_llguidance_cannot_compile_still_gets_a_call_with_any_object(grammars, tokenizer):
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    constraint = grammars.tool_constraint(chat_format(tokenizer), odd, "function", "f", True)
    assert grammars.error(constraint) is None
    assert accepts(grammars, tokenizer, constraint, '{"anything": [1]}}\n</tool_call>')


def test_a_tool_schema_that_does_not_compile_is_logged_once_not_on_every_request(tokenizer, caplog):
    # Claude Code re-sends its TaskCreate schema (propertyNames) on every turn.
    fresh = Grammars(tokenizer)
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with caplog.at_level("WARNING", logger="memrad.chat.grammar"):
        for _ in range(3):
            fresh.tool_constraint(chat_format(tokenizer), odd, "auto", None, True)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "tool 'f': its parameters schema does not compile"]


def test_markup_that_is_one_special_token_is_matched_as_that_token(grammars, tokenizer):
    fmt = chat_format(tokenizer)
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")  # standing in for Qwen's </tool_call> token
    grammar = call_grammar(fmt, [("f", {"type": "object"})], "function", True, {"</tool_call>": special})
    assert grammar.splitlines()[0] == f'start: args_0 "}}\\n" <[{special}]>'
    matcher = grammars.matcher(Constraint(grammar, "tool_call", "tool_choice"))
    assert matcher.consume_tokens(tokenizer.encode("{}}\n", add_special_tokens=False) + [special])
    assert matcher.is_accepting()
    # auto mode: the special token itself opens the call (tests/unit/test_auto_tools.py)
    auto = call_grammar(fmt, [("f", {"type": "object"})], "auto", True, {"<tool_call>": special})
    assert auto.splitlines()[0] == f'start: text | text <[{special}]> "\\n{{\\"name\\": \\"" calls ("\\n" <[{special}]> "\\n{{\\"name\\": \\"" calls)*'


def test_the_mask_allows_end_of_sequence_only_where_the_grammar_accepts(grammars, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    constraint = json_constraint(CHOICE, "response_format")
    shaper = Shaper(SamplingParams(temperature=0.0, constraint=constraint), (), len(tokenizer), {eos},
                    grammars.matcher(constraint))
    logits = torch.zeros(len(tokenizer))
    logits[eos] = 100.0  # the model wants to stop at once
    written = []
    while True:
        shaped = shaper(logits)
        token = int(torch.argmax(shaped))
        if token == eos:
            break
        written.append(token)
        shaper.accept(token)
    assert json.loads(tokenizer.decode(written)) in ({"answer": "yes"}, {"answer": "no"})
    assert logits[eos] == 100.0  # the step's logits are not touched


def constrained_ask(engine, messages, rid, constraint, salt=None):
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest(rid, engine.model_id, tuple(ids), text,
                                SamplingParams(temperature=0.0, max_tokens=24, constraint=constraint),
                                cache_salt=salt)
    return engine.generate(request, lambda _: None, lambda: False)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_a_constrained_reply_parses_and_resumed_equals_cold(loaded, kind):
    engine = make_engine(loaded[kind], 16)
    constraint = json_constraint(CHOICE, "response_format")
    messages = [{"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer."},
                {"role": "user", "content": "turn 0: list files, then open README.md"}]
    first = constrained_ask(engine, messages, "t0", constraint)
    assert json.loads(first.text) in ({"answer": "yes"}, {"answer": "no"}) and first.finish_reason == "stop"
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "turn 1: run tests"}]
    warm = constrained_ask(engine, messages, "t1", constraint)
    cold = constrained_ask(engine, messages, "c1", constraint, salt="cold")
    assert warm.decision.outcome == "resumed" and cold.decision.outcome == "cold"
    assert warm.text == cold.text and json.loads(warm.text) in ({"answer": "yes"}, {"answer": "no"})
    assert engine.finished[-2].generated_ids == engine.finished[-1].generated_ids


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_an_auto_tool_grammar_resumes_as_it_runs_cold(loaded, kind):
    """The `auto` tool grammar's mask, with penalties and a seed, is the same in a resumed and
    a cold run: the same tokens."""
    engine = make_engine(loaded[kind], 16)
    constraint = engine.chat.tool_constraint(TOOLS, "auto", None, True)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, constraint=constraint, frequency_penalty=0.5)
    messages = [{"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer."},
                {"role": "user", "content": "turn 0: list files, then open README.md"}]

    def ask(rid, salt=None):
        text, ids = engine.chat.render(messages, TOOLS)
        return engine.generate(GenerationRequest(rid, engine.model_id, tuple(ids), text, params, cache_salt=salt),
                               lambda _: None, lambda: False)

    first = ask("t0")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "turn 1: run tests"}]
    warm, cold = ask("t1"), ask("c1", salt="cold")
    assert (warm.decision.outcome, cold.decision.outcome) == ("resumed", "cold")
    assert engine.finished[-2].generated_ids == engine.finished[-1].generated_ids and warm.text == cold.text


def test_objects_that_name_their_properties_get_no_others(grammars, tokenizer):
    from memrad.chat.grammar import closed

    nested = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                               "free": {"type": "object"}},
              "$defs": {"d": {"type": "object", "properties": {}}}}
    assert closed(nested) == {"type": "object", "additionalProperties": False, "properties": {
        "inner": {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
        "free": {"type": "object"}}, "$defs": {"d": {"type": "object", "properties": {}, "additionalProperties": False}}}
    open_one = {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": True}
    assert closed(open_one) == open_one  # what the schema says is kept
    constraint = json_constraint(nested, "response_format")
    assert accepts(grammars, tokenizer, constraint, '{"inner": {"x": 1}, "free": {"y": 2}}')
    assert not accepts(grammars, tokenizer, constraint, '{"inner": {"x": 1, "z": 2}}')
