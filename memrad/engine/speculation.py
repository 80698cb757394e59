"""Speculation from the context: drafted tokens verified as rows of one decode step, exactly.

A flight whose reply copies its context (memrad.reuse.drafts) feeds its pending token and the
k drafted tokens after it as a run of k + 1 rows of one multi-row step on its own slab
(memrad.engine.decode.batch.BatchStep.runs), beside its neighbours' rows where it decodes batched:

    row         0        1        2     ...   k        | neighbour b | pad ...
    token       pending  d1       d2          dk       | b's pending |
    position    p        p + 1    p + 2       p + k    | p_b         |
    attends     [0, p]   [0, p+1] [0, p+2]    [0, p+k] | [0, p_b]    |   (a run's rows write, then
                                                                           attend, in order, per layer)
    logits      L0       L1       L2          Lk       | b's         |

The flight then takes L0 exactly as a plain step's logits (`Flight.fed`: sampling, grammar,
stops, max_tokens, logprobs, streaming, cancel), and, while the token it took equals the next
draft, the next row's logits too: row i + 1's input is then the token plain decoding would have
fed at p + i + 1, so its logits are the ones the next plain step would compute. The first token
that differs from its draft (or the reply's end) stops it; the rows after are dropped by setting
the slab's length back (`SlabLayer.crop`: the KV is in place). Nothing is accepted that the
flight's own sampling did not choose (a grammar's mask included: a draft the mask refuses is
never what the masked sampling takes; so a draft is cut before the first token the mask refuses,
`Flight.allowed`, and never costs a row), so the reply is plain decoding's whenever each row has
the bits the flight's own step gives that token: under sampling too, with the same generator
draws in the same order (a seed gives the same reply with speculation on or off; a draft is
kept with the probability the target gives it, as standard speculative sampling with a
one-token draft does).

Where that holds, per the step a flight decodes on (chosen at admission, kept to its last token):

    batched step (eager or compiled)   its own step: a run takes the rows its neighbours leave
                                       free (RUN_ROWS rows in all), checked once per step to
                                       give a run's rows their one-at-a-time bits (`runs_exact`:
                                       the compiled graph writes every row's KV before the
                                       attention that reads it)
    eager one-row step                 an eager batched step of k + 1 rows whose row has the
                                       one-row step's bits (bf16 on the int4 and block kernels;
                                       not fp32, where a matmul's row depends on M), checked once
                                       (`Decoder.verify_step`)
    compiled one-row step              none: a request decodes on it only while the compiled
                                       batched packages are not open (or max_batch = 1), and
                                       those are the only compiled multi-row graphs; plain

Anything else (transformers' forward, Gemma 3 and the hybrids, a check that failed) decodes
plain, and its record says why.
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
MOST_DRAFTED = 8  # tokens drafted at most per step on the eager one-row step (the draft length starts there)
# The rows of the batched step a request's run may take (its pending token and up to 7 drafts):
# with speculation on, the batched packages are built for this many rows too (memrad.engine.decode.
# decoder, `run_rows`), where max_batch is fewer; a step runs the smallest package that holds its rows.
RUN_ROWS = 8


class Speculating:
    """One flight's drafting: the index over its prompt and reply, the draft length, the figures.
    Mutated by the engine thread, once per decode step of its flight.

    `steps(n)`: the step that verifies a run of n rows for a flight on a one-row step (None: no
    such step now, and speculation turns off for the rest of the reply); None for a flight on a
    batched step, whose runs share that step with its neighbours."""

    def __init__(self, most: int, reason: str, steps: Callable[[int], BatchStep | None] | None = None) -> None:
        self.steps = steps
        self.length = DraftLength(most, most)
        self.reason = reason
        self.off: str | None = None  # set when no step could verify a run mid-reply
        self._index: DraftIndex | None = None
        self._parked: DraftIndex | None = None  # the index of the session this flight replaces
        self._prompt_len = 0
        self.drafted = self.accepted = self.verify_steps = self.decode_steps = self.fed = 0

    def resume(self, parked: DraftIndex) -> None:
        """Start from the index parked with the session this flight resumes and replaces (it is
        the flight's now: cut back and extended in place at the first draft)."""
        self._parked = parked

    def draft(self, prompt: tuple[int, ...], generated: list[int], room: int) -> list[int]:
        """The tokens to verify after the pending one (generated[-1]): at most `room`, [] while
        paused or where the context holds no match. Indexes the prompt at the first call: from the
        resumed session's index where there is one (the tokens past the shared prefix), else whole."""
        if self.off is not None or self.length.paused or room < 1:
            return []
        if self._index is None:
            self._index = self._parked if self._parked is not None else DraftIndex()
            self._index.follow(prompt)
            self._parked, self._prompt_len = None, len(prompt)
        index = self._index
        index.extend(generated[len(index) - self._prompt_len :])
        return index.propose(min(self.length.k, room))

    def parked_index(self, token_ids: tuple[int, ...]) -> DraftIndex | None:
        """The index to park with the session this flight leaves, over exactly `token_ids` (its
        prompt and the tokens fed); None where the flight holds none (it never drafted, and
        resumed no session with one)."""
        index = self._index if self._index is not None else self._parked
        if index is not None:
            index.follow(token_ids)
        return index

    def step_for(self, rows: int) -> BatchStep | None:
        """A one-row flight's step for a run of `rows` rows; None turns speculation off."""
        step = self.steps(rows) if self.steps is not None else None
        if step is None:
            self.off = f"no multi-row step of {rows} rows has the one-row step's bits here"
        return step

    def record(self, drafted: int, accepted: int, fed: int) -> None:
        """One verify step: `drafted` offered, `accepted` kept, `fed` rows taken (accepted + 1,
        fewer where the reply ended inside the run)."""
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
    split attention reads one row past the last written; a compiled graph's longest row is
    capacity - 1); 0 where a layer is not a SlabLayer."""
    if not all(type(layer) is SlabLayer and layer.is_initialized for layer in cache.layers):
        return 0
    return max(0, min(layer.slab.capacity for layer in cache.layers) - position - 3)


def cut_back(cache: Any, length: int) -> None:
    """Drop the rows of rejected drafts: every layer holds `length` rows again."""
    for layer in cache.layers:
        if layer.length > length:
            layer.crop(length - layer.length)


def plan(setting: str, decoder: Any, feed: Any, native: bool = False) -> Speculating | Speculation:
    """Whether a new flight decoding with `feed` speculates: its drafting state, or the record
    saying why not. Fixed for the flight's life, as its feed is. May run a step's one-time
    checks (`Decoder.runs_exact`) on a scratch request. `native`: the flight runs at the
    native rope on a twin of the step (memrad.engine.decode.native), and so do the eager
    one-row step's verify steps (`Decoder.verify_step`)."""
    if setting == "off":
        return Speculation(False, "speculate = off")
    if decoder.step is None:
        return Speculation(False, f"transformers' forward decodes this model ({decoder.choice.reason})")
    if not isinstance(decoder.eager_step, DecodeStep):  # LFM2's, Gemma's batched steps: no rows to cut back
        return Speculation(False, "no multi-row step whose rejected drafts can be cut back for this model "
                                  "(Gemma's sliding windows, the hybrids, LFM2's conv state)")
    if isinstance(feed, BatchStep):
        if not all(decoder.runs_exact(step) for step in (*feed.smaller, feed)):
            return Speculation(False, f"the {feed.step} batched step does not give a run of rows on one slab "
                                      "its rows' one-at-a-time bits here")
        return Speculating(feed.rows - 1, f"on the {feed.step} batched step of {feed.rows} rows, up to "
                                          f"{feed.rows - 1} drafted in the rows its neighbours leave")
    if feed.step != "eager":
        return Speculation(False, _COMPILED_ONE_ROW)
    return Speculating(MOST_DRAFTED, f"on the eager step, up to {MOST_DRAFTED} drafted",
                       lambda rows: decoder.verify_step(feed, rows, native))


def drafts_for(flight: Any, rows_free: int) -> list[int]:
    """The drafts `flight` verifies in this step: no more than `rows_free` rows, its max_tokens
    (each row takes one token) and its slab's room allow, cut at the first its grammar refuses;
    [] for a flight that does not speculate."""
    drafting = flight.speculating
    if drafting is None:
        return []
    left = flight.max_tokens - len(flight.out.generated)
    most = min(rows_free, left - 1, room(flight.cache, flight.position))
    return flight.allowed(drafting.draft(flight.request.prompt_ids, flight.out.generated, most))


@torch.inference_mode()
def take_run(flight: Any, logits: torch.Tensor, drafts: list[int]) -> None:
    """`flight` fed its pending token and `drafts` as one run; `logits` [1 + len(drafts), V]:
    take what plain decoding would have, cut the rest of the run back, count it."""
    drafting = flight.speculating
    if not drafts:
        flight.fed(logits[0])
        if drafting is not None:
            drafting.plain_step()
        return
    before = flight.out.num_fed
    accepted = flight.fed_rows(logits, drafts)
    cut_back(flight.cache, flight.position)
    drafting.record(len(drafts), accepted, flight.out.num_fed - before)


_COMPILED_ONE_ROW = ("the compiled one-row step: its multi-row twin is the compiled batched step, which a request "
                     "decodes on once its packages are open (max_batch > 1, batch_decode = batched; built when a "
                     "request is admitted with speculation on or beside another, or by `memrad pull`)")
