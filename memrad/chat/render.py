"""Turning a request into prompt text and token ids with the model's own tokenizer."""

from __future__ import annotations

import json
from typing import Any

from memrad.chat.format import ChatFormat, uses_tools


class PromptError(ValueError):
    """The request cannot be rendered with this model's tokenizer; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                fmt: ChatFormat | None = None, reply_opening: str = "") -> tuple[str, list[int]]:
    """Render with the chat template (generation prompt appended, then `reply_opening`: the
    start of a required tool call, memrad.chat.format.call_opening); return (text, ids).

    A conversation with tools uses memra's tool template where the model's own has no tool
    format (`fmt.tool_template`), or memra's convention in the model's own turns
    (`fmt.convention`); a model with neither rejects `tools`. The text is tokenized
    with add_special_tokens=False: the template already wrote every control token it wants,
    and adding a BOS twice would shift every position.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "this model has no chat template; send a raw prompt to /v1/completions instead",
            "messages",
        )
    template = None
    if fmt is not None and tools and not fmt.tools_supported:
        raise PromptError("this model's chat template has no tool format, so it cannot be given tools; "
                          "leave out tools, serve a model whose template supports them, or turn "
                          "memra's tool convention back on (tools.fallback = true)", "tools")
    if fmt is not None and fmt.tool_template is not None and uses_tools(messages, tools):
        template = fmt.tool_template  # memra's own: writes a system turn anywhere
    if fmt is not None and template is None and not fmt.system_anywhere:
        messages = fold_systems(messages)
    if fmt is not None and template is None and fmt.convention is not None and uses_tools(messages, tools):
        messages, tools = fmt.convention.rewrite(template_messages(messages), tools), None
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=False,
            chat_template=template,
        )
    except Exception as exc:  # jinja raise_exception() and template errors
        raise PromptError(f"the model's chat template rejected these messages: {exc}", "messages") from exc
    text += reply_opening
    return text, encode_text(tokenizer, text, add_special_tokens=False)


def fold_systems(messages: list[dict]) -> list[dict]:
    """Messages for a template that writes a system turn only first: the leading system
    messages merge into one; a later one (Claude Code sends one after its first user turn,
    even as the last message) is appended to the nearest user message before it, else put
    before the next one. Earlier turns keep their bytes as the conversation grows, so reuse
    holds across turns."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}] if lead else []
    waiting: list[str] = []  # system texts with no user message before them
    for message in messages[lead:]:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if message["role"] == "system" and users:
            out[users[-1]] = {**out[users[-1]], "content": out[users[-1]]["content"] + "\n\n" + message["content"]}
        elif message["role"] == "system":
            waiting.append(message["content"])
        elif message["role"] == "user" and waiting:
            out.append({**message, "content": "\n\n".join([*waiting, message["content"]])})
            waiting = []
        else:
            out.append(message)
    if waiting:
        out.append({"role": "user", "content": "\n\n".join(waiting)})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: a call's `arguments` as an object, not the
    JSON text the APIs carry (templates write it with `tojson`)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def _object_arguments(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return call  # validated elsewhere; render as sent
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer)
