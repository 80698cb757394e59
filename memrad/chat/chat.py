"""One model's conversation text: what the server renders, tokenizes and parses through.

Built from the tokenizer and its chat format (memrad.chat.format); pure text work, so the
server reaches it as `engine.chat` without touching the engine's torch side.
"""

from __future__ import annotations

from typing import Any

from memrad.chat.format import ChatFormat, call_opening, chat_format
from memrad.chat.grammar import Grammars
from memrad.chat.parse import ReplyParser
from memrad.chat.render import decode_ids, encode_text, render_chat
from memrad.request import Constraint


class Chat:
    def __init__(self, tokenizer: Any, fmt: ChatFormat | None = None, tool_fallback: bool = True,
                 grammar_compile_s: float | None = None) -> None:
        self.tokenizer = tokenizer
        # How chat turns carry tools and reasoning, and how replies parse (`tool_fallback`:
        # memra's tool convention for a template without one, the `tools.fallback` setting).
        self.format = fmt if fmt is not None else chat_format(tokenizer, tool_fallback)
        # Grammars the reply must match (structured outputs, forced tool calls), compiled once each.
        self.grammars = Grammars(tokenizer, grammar_compile_s)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def render(self, messages: list[dict], tools: list[dict] | None, require_call: bool = False,
               call_name: str | None = None) -> tuple[str, list[int]]:
        """Render a conversation; with `require_call` the reply starts as a tool call (of
        `call_name` if given), opened in the prompt (memrad.chat.format.call_opening)."""
        opening = call_opening(self.format, call_name) if require_call and tools else ""
        return render_chat(self.tokenizer, messages, tools, self.format, opening)

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids)

    def parser(self, prompt_text: str, parse_tools: bool, tool_names: frozenset[str] | None = None) -> ReplyParser:
        """A fresh parser for the reply to `prompt_text` (tool calls parsed if `parse_tools`;
        a call whose name is not in `tool_names`, when given, is content)."""
        return ReplyParser(self.format, prompt_text, parse_tools, tool_names)

    def tool_constraint(self, tools: list[dict], mode: str, name: str | None, parallel: bool) -> Constraint | None:
        """The reply's grammar under tool_choice `mode` (memrad.chat.grammar), None: free."""
        return self.grammars.tool_constraint(self.format, tools, mode, name, parallel)

    def grammar_error(self, constraint: Constraint) -> str | None:
        """Why `constraint` does not compile for this tokenizer (or compiles too slowly), None when it does."""
        return self.grammars.error(constraint)

    @property
    def compiling(self) -> str | None:
        """The request field whose grammar is being (or was last) compiled."""
        return self.grammars.compiling
