"""The Responses API's tool kinds, flattened into memrad's function tools and back. Pure.

    function     {"type": "function", "name", "parameters"}     -> that function
    namespace    {"type": "namespace", "name", "tools": [...]}  -> its functions, flat; the
                                                                   reply's call names the
                                                                   namespace again
    custom       {"type": "custom", "name", "format"?}           -> a function of one string
                                                                   argument `input`; the reply's
                                                                   call is a custom_tool_call
    anything else (web_search, tool_search, image_generation, file_search, local_shell, …):
                 a built-in tool a local model cannot run       -> left out, with a note

Codex sends all four kinds by default; leaving a built-in out is what lets its request run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memrad.chat.reply import ToolCall
from memrad.server.errors import invalid, shown
from memrad.server.tools import function_tool

CUSTOM_INPUT = "input"  # the one argument a custom tool's function takes


@dataclass(frozen=True, slots=True)
class ResponsesTools:
    """A request's tools as the template sees them, and what the reply's calls map back to."""

    tools: tuple[dict, ...] | None  # internal function tools (memrad.server.tools)
    custom: frozenset[str] = frozenset()  # freeform tools: a call's input is one string
    namespaces: tuple[tuple[str, str], ...] = ()  # (function name, the namespace it came from)
    left_out: tuple[str, ...] = ()  # built-in tool types not rendered, in the order sent

    def namespace_of(self, name: str) -> str | None:
        return dict(self.namespaces).get(name)


def responses_tools(value: Any) -> ResponsesTools:
    """`tools` of a Responses body -> ResponsesTools (tools None when none is rendered)."""
    if value is None:
        return ResponsesTools(None)
    if not isinstance(value, list):
        raise invalid("tools must be an array of tool objects", "tools")
    tools: list[dict] = []
    custom: set[str] = set()
    namespaces: list[tuple[str, str]] = []
    left_out: list[str] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            tools.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), where))
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise invalid(f"{where} is a namespace tool: it needs a name and an array of function tools", where)
            for j, fn in enumerate(inner):
                here = f"{where}.tools[{j}]"
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    raise invalid(f"{here} must be a function tool inside namespace {shown(tool['name'])}", here)
                tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), here))
                namespaces.append((fn["name"], tool["name"]))
        elif kind == "custom":
            tools.append(custom_function(tool, where))
            custom.add(tool["name"])
        elif isinstance(kind, str) and kind:
            left_out.append(kind)
        else:
            raise invalid(f"{where} must be a tool object with a type (function, custom, namespace, or a "
                          "built-in tool, which memrad leaves out)", where)
    return ResponsesTools(tuple(tools) or None, frozenset(custom), tuple(namespaces), tuple(left_out))


def custom_function(tool: dict, where: str) -> dict:
    """A freeform tool as a function of one string; its grammar, if any, goes in the description
    (memrad does not constrain decoding, so the model reads the grammar instead)."""
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", where)
    text = description or ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        text += f"\n\nThe input follows this {fmt.get('syntax') or 'grammar'} grammar:\n{fmt['definition']}"
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string",
                                                                   "description": "The whole input, as one string"}},
                  "required": [CUSTOM_INPUT]}
    return function_tool(tool.get("name"), text or None, parameters, where)


def custom_input(arguments: str) -> str:
    """A custom tool call's one string, from the function arguments the model wrote: their
    `input`, else (a model that wrote something else) the arguments text itself."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str):
        return parsed[CUSTOM_INPUT]
    return arguments


def call_item(tools: ResponsesTools, item_id: str, call: ToolCall, status: str, done: bool) -> dict:
    """The output item of one call: a custom_tool_call for a freeform tool, else a function_call
    (naming its namespace where it came from one). `done`: with its arguments/input."""
    if call.name in tools.custom:
        return {"type": "custom_tool_call", "id": item_id, "call_id": call.id, "name": call.name,
                "input": custom_input(call.arguments) if done else "", "status": status}
    item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if done else "", "status": status}
    namespace = tools.namespace_of(call.name)
    if namespace is not None:
        item["namespace"] = namespace
    return item
