"""The internal request's tool vocabulary, shared by all three APIs. Pure: no aiohttp.

Every API's tools, tool choice, calls and results validate into one shape, OpenAI Chat's:

    tool         {"type": "function", "function": {"name", "description"?, "parameters"?}}
    call         {"id", "type": "function", "function": {"name", "arguments": <JSON text>}}
    assistant    {"role": "assistant", "content", "tool_calls"?, "reasoning_content"?}
    tool result  {"role": "tool", "tool_call_id", "content"}

so the chat template sees the same conversation whichever API it came through (test 6d).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from memrad.server.errors import invalid, shown

ToolMode = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the client asked the model to do with its tools. `none` turns tool-call parsing
    off; `required` and `function` open the reply as a call (of the named function,
    memrad.chat.format.call_opening) whose rest is constrained (memrad.chat.grammar)."""

    mode: ToolMode = "auto"
    name: str | None = None  # the function a `function` choice names


# A tool's name: what OpenAI and Anthropic accept, plus `.` and `:` (namespaced MCP tools). The
# name is written into the prompt and the call grammar: markup (`</tool_call>`), quotes or
# blanks in it would make every call of it unparseable, so it comes back as content.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict:
    """One tool in the internal shape, from the parts every API has. A call's arguments are a
    JSON object, so a parameters schema must describe one (or say nothing of its type)."""
    if not isinstance(name, str) or not name:
        raise invalid(f"{where} needs a non-empty function name", where)
    if TOOL_NAME.fullmatch(name) is None:
        raise invalid(f"{where}'s name {shown(name)} must be 1 to 128 letters, digits, '_', '-', '.' or ':'",
                      where, code="invalid_tool_name")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", where)
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}'s parameters must be a JSON schema object", where)
    kind = (parameters or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise invalid(f"{where}'s parameters must be a schema of an object (a call's arguments are a JSON "
                      f"object); its type is {shown(kind)}", where, code="invalid_tool_parameters")
    function: dict = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


ToolParts = tuple[Any, Any, Any]  # one tool's name, description and parameters, as sent


def function_tools(value: Any, array_of: str, parts: Callable[[Any, str], ToolParts]) -> tuple[dict, ...] | None:
    """Any API's `tools` array -> internal tools (None when absent or empty).

    `parts(tool, where)` reads one tool in the API's shape, or raises the API's 400 for a
    tool memrad does not serve; `array_of` says what the array holds, for the 400 when
    `tools` is not an array.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid(f"tools must be an array of {array_of}", "tools")
    return tuple(function_tool(*parts(tool, f"tools[{i}]"), f"tools[{i}]") for i, tool in enumerate(value)) or None


def tool_names(tools: tuple[dict, ...] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


def check_choice(choice: ToolChoice, tools: tuple[dict, ...] | None, param: str = "tool_choice") -> ToolChoice:
    """A named or required choice needs the tools it refers to."""
    if choice.mode in ("required", "function") and not tools:
        raise invalid(f"{param} asks for a tool call but the request lists no tools", param)
    if choice.mode == "function" and choice.name not in tool_names(tools):
        names = tool_names(tools)
        listed = ", ".join(names[:20]) + (f", ... ({len(names)} tools)" if len(names) > 20 else "")
        raise invalid(f"{param} names the function {shown(choice.name)}, which is not among the tools ({listed})",
                      param)
    return choice


OPENAI_MODES = ("auto", "none", "required")  # the bare-string tool choices of Chat and Responses


def tool_choice_of(value: Any, tools: tuple[dict, ...] | None, named: Callable[[dict], tuple[ToolMode, Any] | None],
                   expected: str, words: tuple[str, ...] = ()) -> ToolChoice:
    """Any API's `tool_choice` -> ToolChoice, checked against the tools (default: auto).

    `words` are the bare strings the API takes as modes; `named(value)` reads an object as
    (mode, function name), None for one the API does not define; `expected` finishes the
    400's "tool_choice must be ...".
    """
    if value is None:
        return ToolChoice()
    if value in words:
        return check_choice(ToolChoice(value), tools)
    read = named(value) if isinstance(value, dict) else None
    if read is None:
        raise invalid(f"tool_choice must be {expected}", "tool_choice")
    return check_choice(ToolChoice(*read), tools)


def tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    """One call in the internal shape. `arguments`: JSON text of an object, or the object.

    Arguments that are not an object's JSON (a model's malformed call, echoed back by the
    client) are kept as sent: the template writes them as a JSON string, the same bytes
    every turn, instead of refusing a history the client cannot change.
    """
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where} needs a non-empty call id", where)
    if not isinstance(name, str) or not name:
        raise invalid(f"{where} needs a non-empty function name", where)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        text = json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def assistant_message(content: str, tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def tool_result(call_id: Any, content: str, where: str) -> dict:
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where} needs the id of the tool call it answers", where)
    return {"role": "tool", "tool_call_id": call_id, "content": content}
