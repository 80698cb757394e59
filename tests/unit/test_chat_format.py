"""Tool formats and reply parsing per template family, on offline tokenizers (issue 11, 6b)."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from formats import family_tokenizer
from memrad.chat.format import RESPONSE_TEMPLATES, call_opening, chat_format
from memrad.chat.detokenize import IncrementalDetokenizer
from memrad.chat.render import PromptError, render_chat
from memrad.chat.parse import ReplyParser, parse_reply
from memrad.chat.reply import ReplyBuilder
from tiny import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "read a.py"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}

# family -> (a reply with reasoning, text and two calls where the format allows, the calls it holds)
REPLIES = {
    "qwen3": ('<think>\nLook first.\n</think>\n\nReading it.\n<tool_call>\n{"name": "read_file", "arguments": '
              '{"path": "a.py"}}\n</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>',
              [("read_file", {"path": "a.py"}), ("ls", {})]),
    "llama31": ('<think>\nLook first.\n</think>\n\n{"name": "read_file", "parameters": {"path": "a.py"}}',
                [("read_file", {"path": "a.py"})]),
    "mistral": ('<think>\nLook first.\n</think>\n\nReading it.[TOOL_CALLS][{"name": "read_file", "arguments": '
                '{"path": "a.py"}}, {"name": "ls", "arguments": {}}]', [("read_file", {"path": "a.py"}), ("ls", {})]),
}
CONTENT = {"qwen3": "Reading it.", "llama31": "", "mistral": "Reading it."}
FAMILY_OF = {"qwen3": "hermes", "llama31": "llama3", "mistral": "mistral"}


@pytest.fixture(scope="module", params=sorted(REPLIES))
def family(request):
    tok = family_tokenizer(request.param)
    fmt = chat_format(tok)
    prompt, _ = render_chat(tok, USER, TOOLS, fmt)
    return request.param, tok, fmt, prompt


def streamed(fmt, prompt, chunks, parse_tools=True):
    parser, built = ReplyParser(fmt, prompt, parse_tools), ReplyBuilder()
    for chunk in chunks:
        built.extend(parser.feed(chunk))
    built.extend(parser.finish())
    return built.reply()


def test_each_family_is_detected_with_its_own_tool_format(family):
    name, _, fmt, _ = family
    assert (fmt.family, fmt.tools_supported, fmt.tool_template) == (FAMILY_OF[name], True, None)


def test_a_chatml_template_without_tools_gets_memras_hermes_template():
    tok = build_tokenizer("chatml")
    fmt = chat_format(tok)
    assert fmt.family == "hermes" and fmt.tools_supported and fmt.tool_template is not None
    conversation = [{"role": "system", "content": "Be brief."}, *USER,
                    {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "x = 2"}]
    text, ids = render_chat(tok, conversation, TOOLS, fmt)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "read_file"' in text
    assert ('<|im_start|>assistant\n<think>\nLook.\n</think>\n\n<tool_call>\n{"name": "read_file", "arguments": '
            '{"path": "a.py"}}\n</tool_call><|im_end|>\n') in text
    # Consecutive results share one user turn.
    assert text.endswith("<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response>\n<tool_response>\nx = 2\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    # A conversation without tools keeps the model's own template.
    assert render_chat(tok, USER, None, fmt)[0] == tok.apply_chat_template(USER, tokenize=False,
                                                                         add_generation_prompt=True)


def test_a_template_without_any_tool_format_rejects_tools_when_the_fallback_is_off():
    tok = build_tokenizer("gemma")
    fmt = chat_format(tok, tool_fallback=False)
    assert not fmt.tools_supported and fmt.convention is None
    with pytest.raises(PromptError) as err:
        render_chat(tok, USER, TOOLS, fmt)
    assert err.value.param == "tools" and "no tool format" in str(err.value)


def test_the_whole_reply_parses_into_reasoning_content_and_calls(family):
    name, tok, fmt, prompt = family
    text, calls = REPLIES[name]
    reply = parse_reply(fmt, prompt, text)
    assert reply.reasoning == "Look first."
    assert reply.content == CONTENT[name]
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in reply.tool_calls)
    # The same regions as transformers' own parse_response with the family's template.
    theirs = tok.parse_response(text, RESPONSE_TEMPLATES[FAMILY_OF[name]], prefix=prompt)
    flat = [c for item in theirs["tool_calls"] for c in (item if isinstance(item, list) else [item])]
    assert [(c["name"], c.get("arguments", c.get("parameters"))) for c in flat] == calls
    assert theirs["reasoning_content"].strip() == reply.reasoning


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_chunking_of_a_stream_parses_as_the_whole_reply(family, cuts):
    name, _, fmt, prompt = family
    text = REPLIES[name][0]
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole, parts = parse_reply(fmt, prompt, text), streamed(fmt, prompt, chunks)
    assert (parts.content, parts.reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in parts.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_a_stream_cut_anywhere_never_shows_markup(family, caplog):
    """max_tokens or a stop string can end the reply inside a think block or a call."""
    name, _, fmt, prompt = family
    text = REPLIES[name][0]
    caplog.set_level(logging.ERROR, "memrad.chat.reply")
    for end in range(len(text) + 1):
        reply = streamed(fmt, prompt, list(text[:end]))
        for field in (reply.content, reply.reasoning or ""):
            assert not any(tag[:2] in field for tag in fmt.markup), (end, field)
    inside_think = text.index("Look first.") + 4
    assert streamed(fmt, prompt, [text[:inside_think]]).reasoning == "Look"


def test_a_call_cut_by_max_tokens_comes_back_as_text_not_as_a_call(family):
    name, _, fmt, prompt = family
    text = REPLIES[name][0]
    cut = text[: text.index('"a.py"')]
    reply = streamed(fmt, prompt, [cut])
    assert reply.tool_calls == () and '"read_file"' in reply.content and "<tool_call>" not in reply.content


def test_malformed_tool_json_is_content_with_a_warning(caplog):
    tok = build_tokenizer("chatml")
    fmt = chat_format(tok)
    prompt, _ = render_chat(tok, USER, TOOLS, fmt)
    with caplog.at_level(logging.WARNING, "memrad.chat.reply"):
        reply = parse_reply(fmt, prompt, 'Sure.\n<tool_call>\n{"name": read_file}\n</tool_call>')
    assert reply.tool_calls == () and reply.content == 'Sure.\n{"name": read_file}'
    assert "does not parse" in caplog.text


def test_without_tools_a_tool_tag_is_plain_text_and_reasoning_still_splits():
    tok = build_tokenizer("chatml")
    fmt = chat_format(tok)
    prompt, _ = render_chat(tok, USER, None, fmt)
    reply = parse_reply(fmt, prompt, '<think>hm</think>Use <tool_call> tags.', parse_tools=False)
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("hm", "Use <tool_call> tags.", ())


def test_a_prefilled_think_opener_in_the_prompt_makes_the_reply_start_as_reasoning():
    tok = family_tokenizer("qwen3")
    fmt = chat_format(tok)
    prompt = tok.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                     enable_thinking=True)
    assert prompt.endswith("<think>\n")
    reply = parse_reply(fmt, prompt, "Plan it.\n</think>\n\nDone.")
    assert (reply.reasoning, reply.content) == ("Plan it.", "Done.")


def test_the_detokenizer_keeps_special_markup_tokens():
    tok = family_tokenizer("mistral")
    fmt = chat_format(tok)
    ids = tok(REPLIES["mistral"][0], add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids and fmt.markup_ids
    detok = IncrementalDetokenizer(tok, fmt.markup_ids)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == REPLIES["mistral"][0]


def test_a_response_template_shipped_with_the_tokenizer_wins():
    """transformers' own qwen fallback shape: wrapped calls, its own content close."""
    tok = build_tokenizer("chatml")
    tok.response_template = {
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"thinking": {"open": "<think>", "close": "</think>", "content": "text"},
                   "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                                  "content": "json", "transform": {"type": "function", "function": "{content}"}},
                   "content": {"content": "text"}}}
    fmt = chat_format(tok)
    assert fmt.response_template is tok.response_template
    prompt, _ = render_chat(tok, USER, TOOLS, fmt)
    reply = parse_reply(fmt, prompt, '<think>hm</think>Ok.\n<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    assert (reply.reasoning, reply.content, [(c.name, c.arguments) for c in reply.tool_calls]) == (
        "hm", "Ok.", [("ls", "{}")])


def test_a_shipped_template_that_breaks_mid_reply_degrades_to_content(caplog):
    tok = build_tokenizer("chatml")
    tok.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                                  "transform": {"function": {"name": "{content.name}"}}},
                   "content": {"content": "text"}}}
    fmt = chat_format(tok)
    prompt, _ = render_chat(tok, USER, TOOLS, fmt)
    with caplog.at_level(logging.WARNING, "memrad.chat.reply"):
        reply = streamed(fmt, prompt, ["Ok. <tool_call>", '{"nm": 1}', "</tool_call>"])
    assert reply.tool_calls == () and reply.content == 'Ok.{"nm": 1}'
    assert "reply parsing failed" in caplog.text


def test_a_required_call_opened_in_the_prompt_parses_from_the_models_continuation(family):
    """tool_choice required / named: the reply's opening is part of the prompt, and the parser
    reads on from it: what the model writes next completes the call, in every family."""
    name, tok, fmt, _ = family
    arguments_key = "parameters" if FAMILY_OF[name] == "llama3" else "arguments"
    tail = "}]" if FAMILY_OF[name] == "mistral" else ("}" if FAMILY_OF[name] == "llama3" else "}\n</tool_call>")
    for call_name, continuation in ((None, f'read_file", "{arguments_key}": {{"path": "a.py"}}{tail}'),
                                    ("read_file", f'{{"path": "a.py"}}{tail}')):
        opening = call_opening(fmt, call_name)
        prompt, ids = render_chat(tok, USER, TOOLS, fmt, opening)
        assert opening and prompt.endswith(opening) and ids == tok(prompt, add_special_tokens=False)["input_ids"]
        reply = streamed(fmt, prompt, [continuation[:5], continuation[5:]])
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("read_file", {"path": "a.py"})]
        assert reply.content == ""
