"""`tool_choice: auto` in every family memra serves (memrad.chat.grammar): the reply is free
text or a call, and once the call opens it is constrained to a given tool and its schema,
whether the call opens with a text tag (Hermes, memra's template and its convention), with
one special token (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`) or with no tag at all
(Llama-3, where a call is the whole reply)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from formats import family_tokenizer
from memrad.chat.format import chat_format
from memrad.chat.grammar import Grammars
from memrad.chat.parse import parse_reply
from memrad.chat.render import render_chat
from memrad.engine.sampling import Shaper, make_generator, sample
from memrad.request import SamplingParams
from tiny import build_tokenizer

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
           "required": ["unit", "ok"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
ASK = [{"role": "user", "content": "What time is it?"}]


def qwen_with_tag_tokens():
    tok = family_tokenizer("qwen3")
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's vocabulary has them: one token each
    return tok


# name -> (tokenizer, a reply that calls clock, the text that opens a call)
FAMILIES = {
    "chatml (memra's template)": (build_tokenizer, 'Checking. <tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>', "<tool_call>"),
    "gemma (memra's convention)": (lambda: build_tokenizer("gemma"), '<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>', "<tool_call>"),
    "qwen3 (text tag)": (lambda: family_tokenizer("qwen3"), 'Sure.\n<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>', "<tool_call>"),
    "qwen (tag is a token)": (qwen_with_tag_tokens, 'Sure.\n<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>', "<tool_call>"),
    "llama3.1 (no tag)": (lambda: family_tokenizer("llama31"), '{"name": "clock", "parameters": {"tz": "utc"}}', "{"),
    "llama3.1 (after reasoning)": (lambda: family_tokenizer("llama31"), '<think>\nA time question.\n</think>\n{"name": "clock", "parameters": {"tz": "utc"}}', "<think>\nA time question.\n</think>\n{"),
    "llama3.1 (python tag)": (lambda: family_tokenizer("llama31"), '<|python_tag|>{"name": "clock", "parameters": {"tz": "utc"}}', "<|python_tag|>"),
    "mistral (tag is a token)": (lambda: family_tokenizer("mistral"), 'Sure. [TOOL_CALLS][{"name": "clock", "arguments": {"tz": "utc"}}]', "[TOOL_CALLS]"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    make, call, opener = FAMILIES[request.param]
    tok = make()
    fmt = chat_format(tok)
    prompt, _ = render_chat(tok, ASK, TOOLS, fmt)
    return request.param, tok, fmt, Grammars(tok), prompt, call, opener


def consumed(grammars, tok, constraint, text) -> tuple[bool, bool]:
    """(every token of `text` allowed, the grammar accepts the end there)."""
    matcher = grammars.matcher(constraint)
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return ok, ok and matcher.is_accepting()


def test_auto_takes_text_or_a_call_of_a_given_tool_and_nothing_else(family):
    name, tok, fmt, grammars, prompt, call, opener = family
    constraint = grammars.tool_constraint(fmt, TOOLS, "auto", None, parallel=True)
    assert constraint is not None and grammars.error(constraint) is None, name
    assert consumed(grammars, tok, constraint, "It is noon, I think.") == (True, True)
    assert consumed(grammars, tok, constraint, "<think>\nEasy.\n</think>\n\nIt is noon.") == (True, True)
    assert consumed(grammars, tok, constraint, call) == (True, True)
    reply = parse_reply(fmt, prompt, call, True, frozenset(SCHEMAS))
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("clock", {"tz": "utc"})]
    for bad in (call.replace('"clock"', '"2 + 3"'), call.replace('"utc"', '"mars"'),
                call.replace('{"tz": "utc"}', '{"tz": "utc", "extra": 1}')):
        assert consumed(grammars, tok, constraint, bad)[0] is False, (name, bad)


def test_a_tag_spelled_out_of_plain_tokens_opens_no_unconstrained_call(family):
    """Where the tag is one special token (or, in Llama-3, where the reply itself is the call),
    text that spells it out would still parse as a call: the grammar refuses it."""
    name, tok, fmt, grammars, prompt, call, opener = family
    constraint = grammars.tool_constraint(fmt, TOOLS, "auto", None, parallel=True)
    prefix = "" if name.startswith("llama") else "Hi "  # a Llama-3 call opens the reply
    rest = call[call.index(opener) + len(opener):].replace('"clock"', '"2 + 3"')
    ids = (tok.encode(prefix, add_special_tokens=False) + [i for ch in opener for i in tok.encode(ch, add_special_tokens=False)]
           + tok.encode(rest, add_special_tokens=False))
    assert parse_reply(fmt, prompt, tok.decode(ids), True).tool_calls, name  # the parser would read a call
    matcher = grammars.matcher(constraint)
    assert not all(matcher.consume_token(i) for i in ids), name


def random_reply(tok, grammars, constraint, seed: int, opener: str | None, max_tokens: int = 160):
    """Text written under the mask from random logits (a model that could write anything),
    after `opener` where given (the model chose to open a call)."""
    shaper = Shaper(SamplingParams(temperature=1.0, constraint=constraint), (), len(tok), {tok.eos_token_id},
                    grammars.matcher(constraint))
    ids = tok.encode(opener, add_special_tokens=False) if opener else []
    for token_id in ids:
        shaper.accept(token_id)
    generator, scores = make_generator(seed), torch.Generator().manual_seed(seed)
    while len(ids) < max_tokens and not shaper.complete:
        token = sample(shaper(torch.randn(len(tok), generator=scores) * 3), SamplingParams(temperature=1.0), generator)
        if token == tok.eos_token_id:
            break
        ids.append(token)
        shaper.accept(token)
    return tok.decode(ids), len(ids) < max_tokens


@pytest.mark.parametrize("seed", range(6))
def test_whatever_a_model_writes_under_auto_is_text_or_a_valid_call(family, seed):
    name, tok, fmt, grammars, prompt, call, opener = family
    constraint = grammars.tool_constraint(fmt, TOOLS, "auto", None, parallel=True)
    text, ended = random_reply(tok, grammars, constraint, seed, opener if seed % 2 else None)
    reply = parse_reply(fmt, prompt, text, True, frozenset(SCHEMAS))
    for made in reply.tool_calls:
        jsonschema.validate(json.loads(made.arguments), SCHEMAS[made.name])
    if seed % 2 and ended:  # it opened a call and finished: the call parses
        assert len(reply.tool_calls) >= 1, (name, text)
