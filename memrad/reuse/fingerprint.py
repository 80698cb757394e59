"""The structural fingerprint: one hash per rendered message, chained.

The prompt's token ids are split at the control tokens a chat template emits to open a
message, so one segment is one message (the preamble before the first opener, e.g. a BOS,
folds into the first segment). Each segment is hashed over its first 8 and last 8 token
ids only, never its interior: deleting text inside a message (a stripped <think> block, a
compacted tool output) leaves the hash unchanged when the segment's edges are unchanged.

    ids:    <s> <|im_start|> system ... <|im_end|> \\n <|im_start|> user ... <|im_end|> \\n <|im_start|> assistant \\n
            |------------- segment 0 ----------------|---------- segment 1 ------------|------ segment 2 ------|
    hash:   xxh64(first 8 + last 8 ids of each segment); the chain is the tuple of hashes.

A prompt without control tokens (a raw completion) has no segments and never nominates.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

EDGE = 8


@dataclass(frozen=True, slots=True)
class Segment:
    start: int  # token span [start, end)
    end: int
    hash: int


def segment_spans(ids: Sequence[int], openers: frozenset[int]) -> list[tuple[int, int]]:
    cuts = [i for i, token in enumerate(ids) if token in openers]
    if not cuts:
        return []
    starts = [0] + cuts[1:]
    return list(zip(starts, starts[1:] + [len(ids)]))


def edge_hash(ids: Sequence[int]) -> int:
    """xxh64 over the first and last EDGE ids (all of them when the segment is short)."""
    edges = list(ids) if len(ids) <= 2 * EDGE else list(ids[:EDGE]) + list(ids[-EDGE:])
    return xxhash.xxh64_intdigest(array("q", edges).tobytes())


def segments(ids: Sequence[int], openers: frozenset[int]) -> tuple[Segment, ...]:
    return tuple(Segment(a, b, edge_hash(ids[a:b])) for a, b in segment_spans(ids, openers))


def chain(ids: Sequence[int], openers: frozenset[int]) -> tuple[int, ...]:
    return tuple(s.hash for s in segments(ids, openers))


def shared_segments(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common leading run of two chains."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_PROBES = (
    [{"role": "system", "content": "MEMRAPROBEA"}, {"role": "user", "content": "MEMRAPROBEB"},
     {"role": "assistant", "content": "MEMRAPROBEC"}, {"role": "user", "content": "MEMRAPROBED"}],
    # Templates that refuse a system role (Gemma, some Mistral versions).
    [{"role": "user", "content": "MEMRAPROBEB"}, {"role": "assistant", "content": "MEMRAPROBEC"},
     {"role": "user", "content": "MEMRAPROBED"}],
)


def derive_openers(tokenizer: Any) -> frozenset[int]:
    """The control tokens that open a message, found by rendering a probe conversation.

    Between two messages' contents a template writes the closer of the first (<|im_end|>,
    <|eot_id|>, <end_of_turn>, </s>) and then the opener of the next (<|im_start|>,
    <|start_header_id|>, <start_of_turn>, [INST]); where it writes a single control token
    (Mistral's [/INST] before a reply), that token is the opener.
    """
    special = _special_ids(tokenizer)
    for messages in _PROBES:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        except Exception:  # the template refused this probe shape; try the next
            continue
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        spans = []
        for message in messages:
            at = text.find(message["content"])
            if at < 0:
                break
            spans.append((at, at + len(message["content"])))
        else:
            openers: set[int] = set()
            for (_, prev_end), (next_start, _) in zip(spans, spans[1:]):
                gap = [t for t, (a, b) in zip(ids, offsets) if a >= prev_end and b <= next_start and t in special]
                if gap:
                    openers.add(gap[1] if len(gap) >= 2 else gap[0])
            return frozenset(openers)
    return frozenset()


def derive_reply_header(tokenizer: Any) -> tuple[int, ...]:
    """The ids a template writes before every reply (its generation prompt), e.g.
    <|im_start|> assistant \n for ChatML; () where it writes none that opens with a control
    token (Mistral's [INST] style): then only the grid cuts prefill (memrad.grid).
    """
    messages = [{"role": "user", "content": "probe"}]
    try:
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        prompted = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # no chat template, or one that refuses the probe
        return ()
    if not prompted.startswith(bare) or len(prompted) == len(bare):
        return ()
    header = tokenizer(prompted[len(bare):], add_special_tokens=False)["input_ids"]
    if not header or header[0] not in _special_ids(tokenizer):
        return ()
    return tuple(header)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids
