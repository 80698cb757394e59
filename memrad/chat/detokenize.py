"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong for byte-level and sentencepiece tokenizers (a
character can span tokens; a leading space depends on the previous token). Like vLLM we
decode the window since the last emitted text twice, with and without the newest tokens,
and emit the difference once it no longer ends in a partial character.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, keep: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._keep = keep  # special tokens that are reply markup (e.g. [TOOL_CALLS]): decoded, not skipped
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end: any bytes still held (an incomplete character) as they decode."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        if not self._keep.intersection(ids):
            return self._tokenizer.decode(ids, skip_special_tokens=True)
        parts, run = [], []
        for token in ids:
            if token in self._keep:
                parts += [self._tokenizer.decode(run, skip_special_tokens=True), self._tokenizer.decode([token])]
                run = []
            else:
                run.append(token)
        return "".join(parts) + self._tokenizer.decode(run, skip_special_tokens=True)
