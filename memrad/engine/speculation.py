"""Speculation from the context: drafted tokens verified as rows of one decode step, exactly.

A flight whose reply copies its context (memrad.reuse.drafts) feeds its pending token and the
k drafted tokens after it as k + 1 rows of one multi-row step on its own slab:

    row         0        1        2     ...   k
    token       pending  d1       d2          dk
    position    p        p + 1    p + 2       p + k
    attends     [0, p]   [0, p+1] [0, p+2]    [0, p+k]     (row i sees the rows before it: the
                                                            eager batched step writes row i's KV,
                                                            then attends, row by row, per layer)
    logits      L0       L1       L2          Lk

The flight then takes L0 exactly as a plain step's logits (`Flight.fed`: sampling, grammar,
stops, max_tokens, logprobs, streaming, cancel), and, while the token it took equals the next
draft, the next row's logits too: row i + 1's input is then the token plain decoding would have
fed at p + i + 1, so its logits are the ones the next plain step would compute. The first token
that differs from its draft (or the reply's end) stops it; the rows after are dropped by setting
the slab's length back (`SlabLayer.crop`: the KV is in place). Nothing is accepted that the
flight's own sampling did not choose, so the reply is plain decoding's whenever each row has the
bits the one-row step gives that token: under sampling too, with the same generator draws in the
same order (a seed gives the same reply with speculation on or off; a draft is kept with the
probability the target gives it, as standard speculative sampling with a one-token draft does).

Where that holds (`Speculating.verify`): the eager batched step (memrad.engine.decode.batch)
gives a row the eager one-row step's bits where a matmul's row does not depend on M (bf16 on
the int4 and block kernels), checked once per row count on a scratch request
(`Decoder.verify_step`); where it does (fp32), a flight on the padded batched step verifies on
that very step, at most its rows at once. The compiled steps are not used: their graphs take
each slab as a separate input, so two rows of one request would not see each other's KV rows;
a flight on a compiled step decodes plain, and its record says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memrad.engine.decode.batch import BatchStep
from memrad.engine.decode.steps.llama import DecodeStep
from memrad.engine.state.kv import SlabLayer
from memrad.protocol import Speculation
from memrad.reuse.drafts import DraftIndex, DraftLength

SETTINGS = ("auto", "off")
MOST_DRAFTED = 8  # tokens drafted at most per step (the draft length starts there)

# (cache, tokens [n], position of the first) -> logits [n, V] float32, row i after tokens[i]
Verify = Callable[[Any, list[int], int], torch.Tensor]


class Speculating:
    """One flight's drafting: the index over its prompt and reply, the draft length, the figures.
    Mutated by the engine thread, once per decode step of its flight."""

    def __init__(self, steps: Callable[[int], BatchStep | None], most: int, reason: str) -> None:
        self._steps = steps  # rows -> the step whose rows have this flight's bits, or None
        self.length = DraftLength(most, most)
        self.reason = reason
        self.off: str | None = None  # set when a verify step was refused mid-reply
        self._index: DraftIndex | None = None
        self._prompt_len = 0
        self.drafted = self.accepted = self.verify_steps = self.decode_steps = self.fed = 0

    def draft(self, prompt: tuple[int, ...], generated: list[int], room: int) -> list[int]:
        """The tokens to verify after the pending one (generated[-1]): at most `room`, [] while
        paused or where the context holds no match. Builds the index at the first call."""
        if self.off is not None or self.length.paused or room < 1:
            return []
        if self._index is None:
            self._index, self._prompt_len = DraftIndex(prompt), len(prompt)
        index = self._index
        index.extend(generated[len(index) - self._prompt_len :])
        return index.propose(min(self.length.k, room))

    def verify(self, cache: Any, tokens: list[int], position: int) -> torch.Tensor | None:
        """Logits [len(tokens), V] of rows fed `tokens` at positions from `position` on, each
        row's KV written in place; None (and speculation off for the rest of the reply) where no
        step gives these rows the flight's bits."""
        step = self._steps(len(tokens))
        if step is None:
            self.off = f"no multi-row step of {len(tokens)} rows has the one-row step's bits here"
            return None
        return rows_of_one(step, cache, tokens, position)

    def record(self, drafted: int, accepted: int, fed: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.decode_steps += 1
        self.fed += fed
        self.length.record(drafted, accepted)

    def plain_step(self) -> None:
        self.decode_steps += 1
        self.fed += 1
        self.length.plain_step()

    def figures(self) -> Speculation:
        reason = self.reason if self.off is None else f"{self.reason}; then off: {self.off}"
        return Speculation(True, reason, self.drafted, self.accepted, self.verify_steps, self.decode_steps, self.fed)


def room(cache: Any, position: int) -> int:
    """Draft tokens the slabs hold after the pending row at `position` without growing (the
    split attention reads one row past the last written); 0 where a layer is not a SlabLayer."""
    if not all(type(layer) is SlabLayer and layer.is_initialized for layer in cache.layers):
        return 0
    return min(layer.slab.capacity for layer in cache.layers) - position - 2


@torch.inference_mode()
def rows_of_one(step: BatchStep, cache: Any, tokens: list[int], position: int) -> torch.Tensor:
    """Feed `tokens` [n] to one request as rows 0..n-1 of `step` (eager: rows write, then
    attend, in order, so row i reads rows p..p+i-1 written just before it); the cache's length
    is then position + n, to be cut back to what was accepted. Logits [n, V] float32."""
    n = len(tokens)
    assert 0 < n <= step.rows and not step.compiled, (n, step.rows, step.compiled)
    layers = cache.layers
    assert room(cache, position) >= n - 1, "the caller bounds the draft by `room`"
    slab = [layer.step_buffers(position) for layer in layers]  # [layer] (keys, values) [1, H_kv, capacity, D]
    logits = step._run(step.eager, [slab] * n, list(tokens), [position + i for i in range(n)])
    for layer in layers:
        layer.wrote_row(position + n - 1)
    return logits.float()


def cut_back(cache: Any, length: int) -> None:
    """Drop the rows of rejected drafts: every layer holds `length` rows again."""
    for layer in cache.layers:
        if layer.length > length:
            layer.crop(length - layer.length)


def plan(setting: str, decoder: Any, feed: Any) -> Speculating | Speculation:
    """Whether a new flight decoding with `feed` speculates: its drafting state, or the record
    saying why not. Fixed for the flight's life, as its feed is."""
    if setting == "off":
        return Speculation(False, "speculate = off")
    eager = decoder.eager_step
    if decoder.step is None:
        return Speculation(False, f"transformers' forward decodes this model ({decoder.choice.reason})")
    if not isinstance(eager, DecodeStep):
        return Speculation(False, "no multi-row step for this model (Gemma 3, the hybrids)")
    kernel = feed.kernel if isinstance(feed, BatchStep) else decoder.current[1]  # the feed's attention
    if isinstance(feed, BatchStep):
        if feed.compiled:
            return Speculation(False, _COMPILED)
        if feed.alone is None:  # a row's bits depend on M: verify on this very step, padded as it is
            most = min(MOST_DRAFTED, feed.rows - 1)
            return Speculating(lambda n: feed if n <= feed.rows else None, most,
                               f"on the eager batched step of {feed.rows} rows, up to {most} drafted")
    elif decoder.step is not eager:
        return Speculation(False, _COMPILED)
    return Speculating(lambda n: decoder.verify_step(n, kernel), MOST_DRAFTED,
                       f"on the eager step, up to {MOST_DRAFTED} drafted")


_COMPILED = ("the decode step is compiled: its graph takes each slab as its own input, so two rows of one "
             "request would not see each other's KV; speculation runs on the eager step (compile = off)")

