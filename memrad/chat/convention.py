"""memra's tool convention for a chat template that has no tool format of its own (Gemma 3's,
any local folder's): the tool conversation is rewritten into plain turns, which the model's
own template then renders in its own turn markup.

    tools          -> the Hermes "# Tools" block (the wording memra's ChatML template uses) at the
                      head of the system message, or of the first user message where the template
                      has no system turn
    assistant turn -> `<think>` reasoning if any, its content, then one
                      `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` per call (the Hermes
                      markup, as memra's ChatML template writes it)
    tool result    -> a `tool` turn where the template renders one, else the result as
                      `<tool_response>` blocks in a user turn (consecutive results share it)

Replies are parsed by the Hermes regions (`<think>`, `<tool_call>`), anchored at the
template's own generation prompt (`response_template`), so they parse and stream as they do
for ChatML models. Pure text: probes render with the tokenizer's template, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The Hermes tool instructions, the same words memra's ChatML tool template writes.
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments"
               " within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_PROBE = "memra_probe_text"


@dataclass(frozen=True, slots=True)
class Convention:
    """How one template takes memra's tool convention (what its probe renders showed)."""

    system_turn: bool  # the template accepts a system message (else definitions open the first user turn)
    tool_turn: bool  # the template renders a `tool` turn of its own (else results go in user turns)
    reply_anchor: str  # what precedes a reply: the user turn's close and the generation prompt

    def rewrite(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The conversation as plain turns (no `tools`, `tool_calls`, `reasoning_content` or,
        without a tool turn, `tool` roles) carrying the convention's text. Does not mutate
        `messages`, which come as render.template_messages leaves them (a call's arguments
        as an object)."""
        out: list[dict] = []
        results_open = False  # out[-1] is a user turn of results that the next result joins
        for message in messages:
            role = message.get("role")
            if role == "tool" and not self.tool_turn:
                block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
                if results_open:
                    out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
                else:
                    out.append({"role": "user", "content": block})
                results_open = True
                continue
            results_open = False
            if role == "assistant":
                out.append({**_without(_without(message, "tool_calls"), "reasoning_content"),
                            "content": _reply_text(message)})
            elif role == "tool":
                out.append({"role": "tool", "content": message.get("content") or ""})
            else:
                out.append(dict(message))
        if tools:
            out = self._with_definitions(out, tools)
        return out

    def _with_definitions(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        block = TOOLS_INTRO + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOLS_OUTRO
        if messages and messages[0].get("role") == "system" and self.system_turn:
            system = messages[0].get("content") or ""
            return [{**messages[0], "content": (system + "\n\n" if system else "") + block}, *messages[1:]]
        if self.system_turn:
            return [{"role": "system", "content": block}, *messages]
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first_user is None:
            return [{"role": "user", "content": block}, *messages]
        user = messages[first_user]
        return [*messages[:first_user], {**user, "content": block + "\n\n" + (user.get("content") or "")},
                *messages[first_user + 1:]]


def probe(tokenizer: Any) -> Convention | None:
    """How the tokenizer's template takes the convention; None where it cannot render a
    plain user turn followed by markup that opens the reply (nothing to build on)."""
    user = [{"role": "user", "content": _PROBE}]
    bare = _render(tokenizer, user, False)
    prompted = _render(tokenizer, user, True)
    if bare is None or prompted is None or not prompted.startswith(bare) or _PROBE not in bare:
        return None
    if not prompted[prompted.rindex(_PROBE) + len(_PROBE):].strip():
        return None  # nothing marks where a reply starts: replies could not be told from the prompt
    system = _render(tokenizer, [{"role": "system", "content": "memra_probe_system"}, *user], True)
    history = [*user, {"role": "assistant", "content": "ok"}]
    as_tool = _render(tokenizer, [*history, {"role": "tool", "content": "memra_probe_result"}], True)
    as_user = _render(tokenizer, [*history, {"role": "user", "content": "memra_probe_result"}], True)
    as_reply = _render(tokenizer, [*history, {"role": "assistant", "content": "memra_probe_result"}], True)
    # A template that writes unknown roles as someone else's turn does not have a tool turn.
    tool_turn = as_tool is not None and "memra_probe_result" in as_tool and as_tool not in (as_user, as_reply)
    # The reply starts after the last user turn's closing markup and the generation prompt
    # (a template may have no generation prompt of its own: Mistral's reply follows [/INST]).
    anchor = prompted[prompted.rindex(_PROBE) + len(_PROBE):]
    return Convention(system is not None and "memra_probe_system" in system, tool_turn, anchor)


def response_template(hermes: dict, anchor: str) -> dict:
    """The Hermes reply regions, anchored at this template's generation prompt."""
    return {**hermes, "start_anchor": anchor}


def _reply_text(message: dict) -> str:
    """An assistant turn as the model would have written it: reasoning, content, calls."""
    reasoning, content = message.get("reasoning_content"), message.get("content") or ""
    head = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    parts = [content] if content else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}  # arguments as an object (render.template_messages)
        parts.append('<tool_call>\n{"name": ' + json.dumps(function.get("name"), ensure_ascii=False)
                     + ', "arguments": ' + json.dumps(function.get("arguments"), ensure_ascii=False)
                     + "}\n</tool_call>")
    return head + "\n".join(parts)


def _without(message: dict, key: str) -> dict:
    return {k: v for k, v in message.items() if k != key}


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception:  # jinja raise_exception() and template errors: the template refuses this shape
        return None
