"""How a model's chat turns carry tools and reasoning: one place for every template family.

A tokenizer may ship its own `response_template` (transformers' declarative reply parser);
most do not yet. memra then supplies one per template family:

    hermes   ChatML / Qwen: `<tool_call>{"name", "arguments"}</tool_call>`, `<think>…</think>`
    llama3   Llama-3.x JSON: the reply is `{"name", "parameters"}` (optionally after <|python_tag|>)
    mistral  `[TOOL_CALLS][{"name", "arguments"}, …]`

A ChatML model whose own template ignores `tools` (SmolLM2, the default) gets memra's
Hermes-style template, so an agent can use tools with the default model; any other model
whose template has no tool format (Gemma 3's, a local folder's) gets the same convention
written into its own turns (memrad.chat.convention), unless `tools.fallback` is off: then it
rejects `tools` (ChatFormat.tools_supported is False).

Tool-call bodies parse as JSON with `allow_non_json`: malformed JSON comes back as text, and
memrad.engine.reply turns it into content with a warning instead of failing the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memrad.chat.convention import TOOLS_INTRO, TOOLS_OUTRO, Convention, probe, response_template

# The whole reasoning block, shared by every family (a plain `<think>` in a reply is reasoning).
_REASONING = {"open": "<think>", "close": "</think>", "content": "text", "content_args": {"strip": False}}
_CONTENT = {"content": "text", "content_args": {"strip": False}}
_JSON = {"allow_non_json": True, "strip": False}

RESPONSE_TEMPLATES: dict[str, dict] = {
    "hermes": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": _REASONING,
            # \s* swallows the blank line between content and a call, so it opens no empty content region.
            "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                           "content": "json", "content_args": _JSON},
            "content": _CONTENT,
        },
    },
    "llama3": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "fields": {
            "reasoning_content": _REASONING,
            # A call is the whole reply: JSON from the start (or right after the reasoning) to the end.
            "tool_calls": {"open_pattern": r"(?:\A|(?<=</think>))\s*(?:<\|python_tag\|>)?\s*(?=\{)",
                           "repeats": True, "content": "json", "content_args": _JSON},
            "content": _CONTENT,
        },
    },
    "mistral": {
        "defaults": {"role": "assistant"},
        "start_anchor": "[/INST]",
        "fields": {
            "reasoning_content": _REASONING,
            "tool_calls": {"open": "[TOOL_CALLS]", "repeats": True, "content": "json", "content_args": _JSON},
            "content": _CONTENT,
        },
    },
}

# Literal markup per family: a reply cut inside one of these never shows it as content.
MARKUP: dict[str, tuple[str, ...]] = {
    "hermes": ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    "llama3": ("<think>", "</think>", "<|python_tag|>"),
    "mistral": ("<think>", "</think>", "[TOOL_CALLS]"),
}

def _literal(text: str) -> str:
    """`text` as a jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# memra's tool template for ChatML models whose own template has no tool format. Tools go
# into the system turn inside <tools></tools>; calls are <tool_call> JSON; results are
# <tool_response> blocks in a user turn (consecutive results share one turn), as Qwen2.5 does.
HERMES_CHATML_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- " + _literal(TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + _literal(TOOLS_OUTRO + "<|im_end|>\n") + " }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in rest %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# How a call opens, per family: (before the function name, after it). A client that requires
# a call (tool_choice `required`, or a named function) gets the call's opening written at the
# start of the reply: the model continues inside a call, constrained to finish it
# (memrad.chat.grammar), and the parser, which read the opening as part of the prompt, parses it.
CALL_OPENINGS: dict[str, tuple[str, str]] = {
    "hermes": ('<tool_call>\n{"name": "', '", "arguments": '),
    "llama3": ('{"name": "', '", "parameters": '),
    "mistral": ('[TOOL_CALLS][{"name": "', '", "arguments": '),
}


# What closes a call, per family: a forced call's grammar ends with it (memrad.chat.grammar).
CALL_CLOSINGS: dict[str, str] = {"hermes": "}\n</tool_call>", "llama3": "}", "mistral": "}]"}

# The markup that starts a call inside free text, for families whose calls open with a tag
# (text, or one special token: Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`): in `auto` mode
# the reply is free until the model writes it, and a constrained call after. Llama-3's call
# has no tag: it is the whole reply, a JSON object (after `<|python_tag|>` or whitespace).
CALL_TRIGGERS: dict[str, str] = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
BARE_CALL_TAG: dict[str, str] = {"llama3": "<|python_tag|>"}

# What separates parallel calls, per family (the template's newline between Hermes calls);
# a family not listed writes one call per reply.
CALL_SEPARATORS: dict[str, str] = {"hermes": "\n"}


PROBE_TOOL = {"type": "function", "function": {
    "name": "memra_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """What memra knows about one tokenizer's chat turns.

    `tool_template` is set when memra renders tool conversations with its own template;
    `response_template` is None when replies are plain text (no family recognised).
    """

    family: str | None
    response_template: dict | None
    markup: tuple[str, ...]
    tools_supported: bool
    tool_template: str | None = None
    markup_ids: frozenset[int] = frozenset()  # special tokens that are markup: the detokenizer keeps them
    # Whether the model's own template writes a system turn after the first user turn
    # (ChatML does; Gemma and Mistral raise): where not, memrad.chat.render folds them.
    system_anywhere: bool = True
    # Set where a template without a tool format gets memra's convention (memrad.chat.convention):
    # tool conversations are rewritten into plain turns that the model's own template renders.
    convention: Convention | None = None


def family_of(template_text: str) -> str | None:
    """The family a chat template belongs to, from the markup it writes."""
    if "<tool_call>" in template_text or "<|im_start|>" in template_text:
        return "hermes"
    if "[TOOL_CALLS]" in template_text or "[INST]" in template_text:
        return "mistral"
    if "<|start_header_id|>" in template_text:
        return "llama3"
    return None


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's own template writes the tools it is given (probe render)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    return "memra_probe_tool" in text


def renders_mid_system(tokenizer: Any) -> bool:
    """Whether the template writes a system message that comes after other turns (probe render)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                {"role": "system", "content": "memra_probe_system"}, {"role": "user", "content": "go"}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    return "memra_probe_system" in text


def chat_format(tokenizer: Any, tool_fallback: bool = True) -> ChatFormat:
    """Detect the family, the reply parser and the tool rendering for `tokenizer`.

    A template with no tool format of its own gets memra's: the ChatML tool template for
    ChatML, the convention over the model's own turns for any other (`tool_fallback`, the
    `tools.fallback` setting; False: such a model rejects tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    family = family_of(template)
    own = getattr(tokenizer, "response_template", None)
    response = own if own is not None else RESPONSE_TEMPLATES.get(family or "")
    markup = MARKUP.get(family or "", ())
    ids = skipped_markup(tokenizer, markup)
    anywhere = bool(template) and renders_mid_system(tokenizer)
    if template and renders_tools(tokenizer):
        return ChatFormat(family, response, markup, True, markup_ids=ids, system_anywhere=anywhere)
    if family == "hermes" and "<|im_start|>" in template:
        return ChatFormat(family, response, markup, True, HERMES_CHATML_TEMPLATE, ids, anywhere)
    convention = probe(tokenizer) if template and tool_fallback else None
    if convention is None:
        return ChatFormat(family, response, markup, False, markup_ids=ids, system_anywhere=anywhere)
    # Replies then carry Hermes markup whatever the turns look like: parse them as Hermes.
    hermes = MARKUP["hermes"]
    return ChatFormat("hermes", response_template(RESPONSE_TEMPLATES["hermes"], convention.reply_anchor), hermes,
                      True, markup_ids=skipped_markup(tokenizer, hermes), system_anywhere=anywhere,
                      convention=convention)


def skipped_markup(tokenizer: Any, markup: tuple[str, ...]) -> frozenset[int]:
    """Markup literals that are single special tokens, which a skip-special decode would drop."""
    ids = set()
    for tag in markup:
        token_id = tokenizer.convert_tokens_to_ids(tag)
        if (isinstance(token_id, int) and tokenizer.decode([token_id]) == tag
                and tokenizer.decode([token_id], skip_special_tokens=True) == ""):
            ids.add(token_id)
    return frozenset(ids)


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """A conversation that lists tools, calls one or carries a tool result."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def call_opening(fmt: ChatFormat, name: str | None) -> str:
    """The start of a reply that must be a tool call (`name`: the one function it must call);
    "" where the family's call format is unknown (the choice is then only recorded)."""
    if fmt.family not in CALL_OPENINGS or fmt.response_template is None:
        return ""
    head, after_name = CALL_OPENINGS[fmt.family]
    return head if name is None else head + json.dumps(name, ensure_ascii=False)[1:-1] + after_name
