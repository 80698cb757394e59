"""What a JSON schema costs to compile into a grammar, bounded before llguidance sees it. Pure.

llguidance's compile and its lexer grow fast with a few schema shapes (measured on this
2-core machine, 49k vocabulary): `patternProperties` (0.55 s at 150 patterns in one object,
8.3 s at 300, 51 s at 500: each pattern's key set is intersected with the others'), optional
`properties` (1.0 s at 2,000 in one object), and nested counted repetitions in a `pattern`
(`(a{300}){300}` costs 60-70 ms on every decode step; `(a{1000}){1000}` fails at run time
after a 2.2 s first step). A schema past one of these bounds is refused with the part named,
before any compile:

    one object's patternProperties      <= MAX_PATTERN_PROPERTIES
    one object's optional properties    <= MAX_OPTIONAL_PROPERTIES
    every pattern (also patternProperties' keys and propertyNames' patterns):
        length                          <= MAX_PATTERN_CHARS
        nested counted repetitions      product <= MAX_PATTERN_REPEATS  (a{100}: 100, (a{10}){30}: 300)
    subschemas in the whole schema      <= MAX_SUBSCHEMAS

What passes these still has a compile time limit (memrad.server.decoding, limits.grammar_compile_s).
"""

from __future__ import annotations

import re
from typing import Any

MAX_PATTERN_PROPERTIES = 64
MAX_OPTIONAL_PROPERTIES = 512
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_REPEATS = 20_000
MAX_SUBSCHEMAS = 20_000
_CEILING = 10**12  # counts past this are all "too many" (keeps the arithmetic small)
_REPEAT = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")


def pattern_repeats(pattern: str) -> int:
    """How many copies of its atoms a regex spells out once counted repetitions are expanded:
    a sequence or an alternation adds its parts, `{m,n}` multiplies what it follows by n (by m
    for `{m,}`). `*`, `+` and `?` are loops, not copies (1)."""
    stack: list[list[int]] = []
    frame = [0, 0, 0]  # [closed alternatives, this alternative so far, the last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            stack.append(frame)
            frame = [0, 0, 0]
            i += 1
            continue
        if c == "|":
            frame = [min(frame[0] + frame[1], _CEILING), 0, 0]
            i += 1
            continue
        if c == "{" and (m := _REPEAT.match(pattern, i)):
            count = min(int(m.group(3) or m.group(1)), _CEILING)  # {m,n}: n; {m} and {m,}: m
            frame[1] = min(frame[1] + frame[2] * max(count - 1, 0), _CEILING)
            frame[2] = min(frame[2] * count, _CEILING)
            i = m.end()
            continue
        if c in "*+?":
            i += 1
            continue
        if c == ")":
            atom = min(frame[0] + frame[1], _CEILING)
            frame = stack.pop() if stack else [0, 0, 0]
            i += 1
        elif c == "[":  # a class is one atom: skip to its closing bracket
            j = i + 1 + (pattern.startswith("^", i + 1))
            j += pattern.startswith("]", j)
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom, i = 1, j + 1
        else:
            atom, i = 1, i + (2 if c == "\\" else 1)
        frame[1] = min(frame[1] + atom, _CEILING)
        frame[2] = atom
    while stack:
        atom = frame[0] + frame[1]
        frame = stack.pop()
        frame[1] = min(frame[1] + atom, _CEILING)
    return min(frame[0] + frame[1], _CEILING)


def _pattern_problem(pattern: str) -> str | None:
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"a pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})"
    repeats = pattern_repeats(pattern)
    if repeats > MAX_PATTERN_REPEATS:
        return (f"the pattern {pattern[:60]!r}{'...' if len(pattern) > 60 else ''} spells out {repeats:,} characters "
                f"once its counted repetitions are expanded (at most {MAX_PATTERN_REPEATS:,})")
    return None


def costly_part(schema: Any, where: str) -> str | None:
    """Why `schema` (sent as `where`) is too costly to compile, naming the part, or None."""
    seen = 0
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        seen += 1
        if seen > MAX_SUBSCHEMAS:
            return f"{where} holds more than {MAX_SUBSCHEMAS:,} objects; at most {MAX_SUBSCHEMAS:,} are compiled"
        problem = _node_problem(node)
        if problem is not None:
            return f"{path}: {problem}; simplify this part of the schema"
        stack.extend((value, f"{path}.{key}") for key, value in node.items())
    return None


def _node_problem(node: dict) -> str | None:
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        if len(patterns) > MAX_PATTERN_PROPERTIES:
            return f"{len(patterns)} patternProperties in one object (at most {MAX_PATTERN_PROPERTIES})"
        for key in patterns:
            if (problem := _pattern_problem(key)) is not None:
                return f"patternProperties: {problem}"
    properties = node.get("properties")
    if isinstance(properties, dict):
        required = node.get("required")
        optional = len(properties) - len(set(required) & properties.keys() if isinstance(required, list) and all(isinstance(r, str) for r in required) else set())
        if optional > MAX_OPTIONAL_PROPERTIES:
            return f"{optional} optional properties in one object (at most {MAX_OPTIONAL_PROPERTIES})"
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        return _pattern_problem(pattern)
    return None
