"""Scripted agent conversations and the client-side rewrites applied to earlier replies."""

from __future__ import annotations

import re
from dataclasses import dataclass

REWRITES = {
    "none": lambda reply: reply,
    "strip-think": lambda reply: re.sub(r"<think>.*?</think>\s*", "", reply, flags=re.S),
    "trim": lambda reply: reply.strip(),
    "first-paragraph": lambda reply: reply.split("\n\n")[0],
    "half": lambda reply: reply[: len(reply) // 2],
}

TOOLS = "\n".join(
    f"- {name}: {what}. Arguments as JSON; returns plain text, errors as text."
    for name, what in [
        ("read_file(path)", "read a file from the workspace"), ("write_file(path, text)", "replace a file"),
        ("list_dir(path)", "list a directory"), ("grep(pattern)", "search the workspace"),
        ("run_tests()", "run the test suite"), ("git_diff()", "show uncommitted changes"),
    ]
)
SYSTEM = ("You are a careful coding agent in a Python repository. Read before you write, keep changes "
          f"small, run the tests after every change.\nTools:\n{TOOLS}\n")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    system: str
    user_turns: tuple[str, ...]
    max_tokens: int


def _tool_result(i: int, lines: int) -> str:
    return "\n".join(f"src/pkg/module_{i}_{j}.py:{10 * j}: def step_{j}(ctx): return ctx.run({i}, {j})"
                     for j in range(lines))


HISTORY_REWRITES = ("elide-tools",)


def elide_old_tool_output(messages: list[dict], keep_last: int = 2) -> list[dict]:
    """Compact every tool result but the last `keep_last` (what agents do to long histories)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user" and "Tool result:" in m["content"]]
    old = set(users[:-keep_last]) if keep_last else set(users)
    return [dict(m, content=m["content"].split("Tool result:")[0] + "Tool result: [elided]")
            if i in old else m for i, m in enumerate(messages)]


SHORT = Scenario("short", SYSTEM * 2, (
    "List the files in the repository root.",
    f"Tool result:\n{_tool_result(1, 4)}\nWhich of these parses the config?",
    f"Tool result:\n{_tool_result(2, 4)}\nAdd a test for a missing config file.",
    "Run the tests and report what failed.",
), max_tokens=24)

AGENT_25 = Scenario("agent-25", SYSTEM * 4, tuple(
    f"Step {i}. Tool result:\n{_tool_result(i, 6)}\nWhat is the next action?" for i in range(1, 26)
), max_tokens=64)

SCENARIOS = {s.name: s for s in (SHORT, AGENT_25)}
