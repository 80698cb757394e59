"""memra's tool convention on templates without a tool format (tiny Gemma-, Llama-3- and
Mistral-style templates, offline): where definitions, calls and results land in the model's
own turns, and that the reply parser reads calls back, whole and streamed."""

from __future__ import annotations

import json

from memrad.chat.convention import TOOLS_INTRO, TOOLS_OUTRO
from memrad.chat.format import call_opening, chat_format
from memrad.chat.parse import ReplyParser, parse_reply
from memrad.chat.reply import ReplyBuilder
from memrad.chat.render import render_chat
from tiny import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
DEFINITIONS = TOOLS_INTRO + "\n" + json.dumps(TOOLS[0]) + TOOLS_OUTRO
CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
CALL_TEXT = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
ROUND_TRIP = [{"role": "user", "content": "read a.py"},
              {"role": "assistant", "content": "Reading it.", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
              {"role": "tool", "tool_call_id": "call_2", "content": "x = 2"}]
REPLY = '<think>\nLook first.\n</think>\n\nReading it.\n' + CALL_TEXT


def test_gemma_without_a_system_turn_gets_definitions_in_the_first_user_turn_and_tool_turns():
    tok = build_tokenizer("gemma")  # its template raises on a system message
    fmt = chat_format(tok)
    assert fmt.tools_supported and fmt.family == "hermes"
    assert (fmt.convention.system_turn, fmt.convention.tool_turn) == (False, True)
    text, ids = render_chat(tok, ROUND_TRIP, TOOLS, fmt)
    assert text == ("<bos><start_of_turn>user\n" + DEFINITIONS + "\n\nread a.py<end_of_turn>\n"
                    "<start_of_turn>model\nReading it.\n" + CALL_TEXT + "<end_of_turn>\n"
                    "<start_of_turn>tool\nprint(1)<end_of_turn>\n<start_of_turn>tool\nx = 2<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    # Without tools the conversation is the model's own, byte for byte.
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, plain, None, fmt)[0] == tok.apply_chat_template(plain, tokenize=False,
                                                                          add_generation_prompt=True)


def test_a_template_with_a_system_turn_gets_definitions_there():
    tok = build_tokenizer("llama3")
    fmt = chat_format(tok)
    assert fmt.convention.system_turn
    text, _ = render_chat(tok, [{"role": "system", "content": "Be brief."}, *ROUND_TRIP[:1]], TOOLS, fmt)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n"
                           + DEFINITIONS + "<|eot_id|>")
    bare, _ = render_chat(tok, ROUND_TRIP[:1], TOOLS, fmt)
    assert bare.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + DEFINITIONS)


def test_a_template_that_writes_unknown_roles_as_replies_gets_results_in_one_user_turn():
    tok = build_tokenizer("mistral")  # [INST] user [/INST] reply</s>: a tool role would read as a reply
    fmt = chat_format(tok)
    assert (fmt.convention.system_turn, fmt.convention.tool_turn, fmt.convention.reply_anchor) == (
        False, False, "[/INST]")
    text, _ = render_chat(tok, ROUND_TRIP, TOOLS, fmt)
    assert text.endswith("[/INST] Reading it.\n" + CALL_TEXT + "</s>[INST] <tool_response>\nprint(1)\n"
                         "</tool_response>\n<tool_response>\nx = 2\n</tool_response>[/INST]")


def test_replies_parse_back_into_reasoning_content_and_calls_whole_and_streamed():
    for style in ("gemma", "llama3", "mistral"):
        tok = build_tokenizer(style)
        fmt = chat_format(tok)
        prompt, _ = render_chat(tok, ROUND_TRIP, TOOLS, fmt)
        whole = parse_reply(fmt, prompt, REPLY)
        assert (whole.reasoning, whole.content) == ("Look first.", "Reading it."), style
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("read_file", {"path": "a.py"})]
        parser, built = ReplyParser(fmt, prompt, True), ReplyBuilder()
        for i in range(0, len(REPLY), 3):
            for delta in parser.feed(REPLY[i:i + 3]):
                assert "<tool" not in (delta.text or ""), (style, delta)
                built.extend([delta])
        built.extend(parser.finish())
        streamed = built.reply()
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_a_required_call_opens_the_reply_with_the_hermes_call_markup():
    tok = build_tokenizer("gemma")
    fmt = chat_format(tok)
    opening = call_opening(fmt, "read_file")
    assert opening == '<tool_call>\n{"name": "read_file", "arguments": '
    prompt, _ = render_chat(tok, ROUND_TRIP[:1], TOOLS, fmt, opening)
    reply = parse_reply(fmt, prompt, '{"path": "a.py"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("read_file", {"path": "a.py"})]
