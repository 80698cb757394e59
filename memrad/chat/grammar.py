"""Grammars a reply must match, compiled by llguidance: structured outputs and tool calls.

    response_format / text.format / output_config.format   -> json_constraint(schema)
    tool_choice required, or a named function                -> the rest of the call after the
        opening memrad writes into the prompt (memrad.chat.format.call_opening): a name from
        `tools`, arguments valid against that tool's schema, the family's closing markup
    tool_choice auto, a family whose calls open with a tag   -> free text until the model
        writes the tag (text, or the one special token it is), then a call constrained as above
    tool_choice auto, Llama-3 (a call is the whole reply)    -> a reply that opens with `{` (or
        `<|python_tag|>`) is a constrained call, any other is free text

A Constraint is plain text (memrad.request); `Grammars` compiles it for one tokenizer once
per grammar (an LRU cache keyed by the text's hash) and hands each request a fresh matcher,
whose token mask the engine applies to the logits before sampling (memrad.engine.sampling).
llguidance is Rust with no torch, so the server checks a grammar (the 400) without the engine,
on a worker thread of its own (memrad.server.prepare: llguidance releases the GIL), after
the schema's cost bound (memrad.chat.schema_cost, checked with the body's limits).

Compiling includes the first step's mask: llguidance builds its lexer lazily, and a grammar's
first mask can cost seconds (`(a{1000}){1000}`: 2.2 s) that would otherwise stall every
request batched beside it. A compile (with that mask) slower than `compile_limit_s` is an
error, cached like any other, so a re-sent schema is refused at once.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash

from memrad.chat.format import BARE_CALL_TAG, CALL_CLOSINGS, CALL_OPENINGS, CALL_SEPARATORS, CALL_TRIGGERS, ChatFormat
from memrad.request import Constraint

log = logging.getLogger("memrad.chat.grammar")

# One spelling of JSON whitespace, json.dumps's: a grammar that allows any whitespace lets a
# small model pad its reply with newlines until max_tokens instead of closing the object.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_OBJECT: dict = {"type": "object"}
CACHED_GRAMMARS = 64


def _json(schema: dict) -> str:
    """A %json lexeme body: the schema with memra's whitespace style."""
    return json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def json_constraint(schema: dict | None, param: str) -> Constraint:
    """The reply is one JSON value valid against `schema` (None: any JSON object)."""
    return Constraint(f"start: %json {_json(ANY_OBJECT if schema is None else closed(schema))}\n",
                      "json_object" if schema is None else "json_schema", param)


SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object names its properties and
    says nothing of others (OpenAI's and Anthropic's strict mode require it). Still valid
    against the schema as sent, and a small model cannot add keys until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in SUBSCHEMAS:
        if key in out:
            out[key] = closed(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    return out


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_grammar(fmt: ChatFormat, names_and_args: Sequence[tuple[str, dict]], mode: str,
                 parallel: bool, markup_token: dict[str, int] | None = None) -> str | None:
    """Lark text for a reply that is (the rest of) a tool call in `fmt`'s family syntax, or
    None where the family has no known call syntax (or, for `auto`, no way to tell its call from text).

    mode `function`: one tool is given and its name is already in the prompt; `required`: the
    prompt ends inside `{"name": "`; `auto`: free text, then calls once the tag appears (or, in
    Llama-3's syntax, a reply that opens as a call). Parallel calls where the family has a
    separator for them (memrad.chat.format.CALL_SEPARATORS), else one.
    `markup_token`: markup that is one special token in the vocabulary, by text (its id is
    matched, since llguidance never spells a special token out of text).
    """
    if fmt.family not in CALL_OPENINGS or fmt.response_template is None:
        return None
    head, after_name = CALL_OPENINGS[fmt.family]
    closing = CALL_CLOSINGS[fmt.family]
    tokens = markup_token or {}

    def literal(text: str) -> str:
        for tag, token_id in tokens.items():
            if tag in text:
                before, _, after = text.partition(tag)
                return " ".join(p for p in (literal(before) if before else "", f"<[{token_id}]>",
                                            literal(after) if after else "") if p)
        return _string(text)

    rules = [f"args_{i}: %json {_json(schema)}" for i, (_, schema) in enumerate(names_and_args)]
    if mode == "function":
        return "\n".join([f"start: args_0 {literal(closing)}", *rules]) + "\n"
    alternatives = " | ".join(f"call_{i}" for i in range(len(names_and_args)))
    rules += [f"call_{i}: {_string(json.dumps(name, ensure_ascii=False)[1:-1] + after_name)} args_{i} "
              f"{literal(closing)}" for i, (name, _) in enumerate(names_and_args)]
    if mode == "required":
        return "\n".join([f"start: {alternatives}", *rules]) + "\n"
    separator = CALL_SEPARATORS.get(fmt.family)
    again = f" ({literal(separator + head)} calls)*" if parallel and separator is not None else ""
    trigger = CALL_TRIGGERS.get(fmt.family)
    if trigger is None:
        return _bare_call_grammar(fmt, literal(head), alternatives, again, rules, tokens)
    if not head.startswith(trigger):
        return None
    if trigger in tokens:
        # One special token opens the call; text may hold neither it nor the tag spelled out of
        # plain tokens (which the parser would read as an unconstrained call).
        return "\n".join([f"start: text | text {literal(head)} calls{again}", "text: TEXT",
                          f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(trigger)}.*)/",
                          f"calls: {alternatives}", *rules]) + "\n"
    # A lazy lexeme: the text ends where the model writes the tag.
    return "\n".join([f"start: text | text_call {literal(head[len(trigger):])} calls{again}",
                      "text: /(?s:.*)/", f"text_call[stop={_string(trigger)}]: /(?s:.*)/",
                      f"calls: {alternatives}", *rules]) + "\n"


WHITESPACE = "[ \\t\\r\\n]"  # in a lark regex


def _bare_call_grammar(fmt: ChatFormat, head: str, alternatives: str, again: str, rules: list[str],
                       tokens: dict[str, int]) -> str | None:
    """`auto` for a family whose call is the whole reply, a JSON object with no tag before it
    (Llama-3's, after an optional `<|python_tag|>` token and whitespace, and after a `<think>`
    block if any): text is any reply the parser would not read as a call, one whose first
    non-blank character (or the first after `</think>`) is not `{`."""
    tag = BARE_CALL_TAG.get(fmt.family or "")
    if tag is None:
        return None
    # A few blanks at most (random logits under an unbounded blank run pad until max_tokens).
    opening = f"/{WHITESPACE}{{1,4}}/"
    if tag in tokens:
        opening += f" | /{WHITESPACE}{{0,4}}/ <[{tokens[tag]}]>"
    # `thought` is lazy: at `</think>` the reply goes on as text or as a call.
    return "\n".join([
        f"start: text | thought text | thought? opening? {head} calls{again}",
        'thought[stop="</think>"]: /(?s:<think>.*)/',
        f"opening: {opening}",
        "text: TEXT",  # nor does it open with the tag spelled out of plain tokens
        f"TEXT: /(?s:{WHITESPACE}*([^{{ \\t\\r\\n].*)?)/ & ~/(?s:{WHITESPACE}*{re.escape(tag)}.*)/"
        f" & ~/(?s:.*<\\/think>{WHITESPACE}*\\{{.*)/",
        f"calls: {alternatives}", *rules]) + "\n"


TOO_SLOW = "compiling took"


def too_slow(limit_s: float, took_s: float) -> str:
    return (f"{TOO_SLOW} {took_s:.1f} s, more than limits.grammar_compile_s ({limit_s:g} s); "
            "simplify the schema")


class GrammarTooSlow(Exception):
    """A tool's parameters schema compiled, but slower than the limit: the request is refused
    (its calls must not silently lose their schema)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason


class Grammars:
    """One tokenizer's grammar compiler: checks a Constraint (the 400's reason) and hands
    each request a fresh matcher, copied from a compiled one cached by grammar text."""

    def __init__(self, tokenizer: Any, compile_limit_s: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.compile_limit_s = compile_limit_s  # None: no limit
        self._lltok: Any = None
        # grammar hash -> a matcher at the reply's start, or the reason it cannot be used
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        # The server checks grammars on its worker while the engine thread takes matchers.
        self._lock = threading.Lock()
        self.compiling: str | None = None  # the param whose grammar is being compiled (for a timeout's 400)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _llg_tokenizer(self) -> Any:
        if self._lltok is None:  # 0.3 s for a 49k vocabulary: built once, on first use (a race builds it twice)
            import llguidance.hf

            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._lltok

    def _compile(self, grammar: str) -> Any:
        """The cached matcher for `grammar`, or the reason (str) it cannot be used."""
        from llguidance import LLMatcher

        key = xxhash.xxh3_128_hexdigest(grammar.encode())
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
        # Outside the lock: the engine thread takes matchers of cached grammars meanwhile.
        tokenizer = self._llg_tokenizer()
        started = time.perf_counter()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first step's lexer, built here rather than on the engine's step
        took_s = time.perf_counter() - started
        found = matcher.get_error() if matcher.is_error() else matcher
        if not isinstance(found, str) and self.compile_limit_s is not None and took_s > self.compile_limit_s:
            found = too_slow(self.compile_limit_s, took_s)
        with self._lock:
            self._compiled[key] = found
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return found

    def error(self, constraint: Constraint) -> str | None:
        """Why `constraint` does not compile (or compiles too slowly), or None when it does."""
        self.compiling = constraint.param
        found = self._compile(constraint.grammar)
        # A grammar that does not compile stays cached too: compiling is deterministic, and an
        # agent CLI re-sends the same failing tool schema every turn (Claude Code's TaskCreate).
        return found if isinstance(found, str) else None

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh llguidance matcher at the reply's start (the compiled one stays pristine)."""
        found = self._compile(constraint.grammar)
        if isinstance(found, str):
            raise ValueError(f"{constraint.param}: the grammar cannot be used: {found}")
        return found.deep_copy()

    def token_bytes(self, token_id: int) -> bytes:
        """A token's exact bytes (a byte-level piece of a character is not valid UTF-8 alone)."""
        return self._llg_tokenizer().decode_bytes([token_id])

    def markup_tokens(self, fmt: ChatFormat) -> dict[str, int]:
        """The family's markup that is one special token here (Qwen's `<tool_call>`)."""
        out = {}
        for tag in fmt.markup:
            token_id = self.tokenizer.convert_tokens_to_ids(tag)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id \
                    and tag in getattr(self.tokenizer, "added_tokens_encoder", {}):
                out[tag] = token_id
        return out

    def tool_constraint(self, fmt: ChatFormat, tools: Sequence[dict], mode: str, name: str | None,
                        parallel: bool) -> Constraint | None:
        """The grammar of a reply under `tool_choice` (`mode`, and the function `name` it
        names), or None where the reply stays free. A tool whose parameters schema llguidance
        cannot compile still gets a call, with any JSON object as its arguments (logged)."""
        chosen = [t["function"] for t in tools if mode != "function" or t["function"]["name"] == name]
        grammar = call_grammar(fmt, [(f["name"], self._arguments(f)) for f in chosen], mode, parallel,
                               self.markup_tokens(fmt))
        return None if grammar is None else Constraint(grammar, "tool_call", "tool_choice" if mode != "auto" else "tools")

    def _arguments(self, function: dict) -> dict:
        schema = function.get("parameters") or ANY_OBJECT
        constraint = json_constraint(schema, f"tools ({function['name']})")
        with self._lock:
            known = xxhash.xxh3_128_hexdigest(constraint.grammar.encode()) in self._compiled
        reason = self.error(constraint)
        if reason is None:
            return closed(schema)
        if reason.startswith(TOO_SLOW):
            raise GrammarTooSlow(constraint.param, reason)
        if not known:  # said once per schema, not on every request that re-sends it
            log.warning("tool %r: its parameters schema does not compile (%s); its calls take any JSON object",
                        function["name"], reason.splitlines()[0])
        return ANY_OBJECT
