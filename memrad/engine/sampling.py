"""Next-token choice: shape the step's logits, then greedy at temperature 0, else sample.

    logits -> Shaper: repetition penalty (prompt + reply), frequency / presence penalties
              (reply), logit_bias, the grammar's mask (memrad.chat.grammar), in that order
           -> sample: argmax, or temperature -> top_k -> min_p -> top_p -> multinomial

Everything runs on the CPU in float32 from the step's logits and the request's own tokens,
so it is the same arithmetic in a cold and a resumed run (resumed == cold holds with any of
it), and a per-request generator makes a seed reproduce the same tokens on any device.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from memrad.request import SamplingParams, TokenLogprob

log = logging.getLogger("memrad.engine.sampling")


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [V] float32. Returns the chosen token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().to("cpu", torch.float32) / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # A temperature so small (1e-300 passes validation) that logits / T overflowed: the
        # distribution it asks for is the argmax (found by the fuzzer: multinomial raised).
        return int(torch.argmax(logits))
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        probs = probs / probs.sum()  # top_p is a share of what top_k and min_p left
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = (cumulative - sorted_probs) < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(scores: torch.Tensor, token: int, top: int, token_bytes: Callable[[int], bytes]) -> TokenLogprob:
    """`token`'s log probability under softmax(`scores`) and the `top` likeliest tokens'."""
    logprobs = torch.log_softmax(scores.detach().to("cpu", torch.float32), dim=-1)

    def record(token_id: int, alternatives: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        raw = token_bytes(token_id)
        return TokenLogprob(raw.decode("utf-8", errors="replace"), float(logprobs[token_id]), tuple(raw), alternatives)

    best = torch.topk(logprobs, top) if top else None
    return record(token, tuple(record(int(i)) for i in best.indices) if best is not None else ())


def shapes(params: SamplingParams) -> bool:
    """Whether `params` ask for anything a Shaper does (else the logits are sampled as they are)."""
    return (params.constraint is not None or params.logit_bias != () or params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)


class Shaper:
    """One request's logits shaping. Call it on each step's logits [V] (a shaped copy comes
    back; the step's tensor is not touched), then `accept` the token chosen from them.

    `matcher` is an llguidance matcher (memrad.chat.grammar.Grammars.matcher) or None. The
    end-of-sequence tokens are allowed exactly when the grammar accepts what was written, so a
    constrained reply finishes only where it parses; where the grammar allows nothing more
    (or has failed) only they are left.

    The arithmetic is numpy's, on one thread: a [V] torch op crosses torch's parallel grain
    and waits at an OpenMP barrier, 14 ms a call measured on this 2-core machine under load
    (five such ops made the mask cost 70 ms a step; in numpy it is 0.1 ms).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 eos_ids: Iterable[int], matcher: Any = None) -> None:
        self.params = params
        self.matcher = matcher
        self.eos = np.array(sorted(eos_ids), dtype=np.int64)
        self.counts = np.zeros(vocab_size, dtype=np.float32)  # generated tokens, by id
        self.seen = np.zeros(vocab_size, dtype=np.bool_)  # prompt and generated tokens
        if params.repetition_penalty != 1.0 and prompt_ids:
            self.seen[np.array(prompt_ids, dtype=np.int64)] = True
        self._allowed: np.ndarray | None = None  # the last mask applied
        self._error: str | None = None  # why llguidance gave up, once it has
        self.bias = np.zeros(vocab_size, dtype=np.float32)
        for token_id, bias in params.logit_bias:
            if 0 <= token_id < vocab_size:
                self.bias[token_id] += bias

    def __call__(self, logits: torch.Tensor, allowed: np.ndarray | None = None) -> torch.Tensor:
        """`allowed`: this step's mask if it was computed ahead (`allowed_tokens`, on another
        thread while the step ran: memrad bench speed --grammar measures that overlap)."""
        params = self.params
        out = logits.detach().to("cpu", torch.float32).numpy().copy()
        if params.repetition_penalty != 1.0:
            seen = out[self.seen]
            out[self.seen] = np.where(seen > 0, seen / np.float32(params.repetition_penalty),
                                      seen * np.float32(params.repetition_penalty))
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            out -= (np.float32(params.frequency_penalty) * self.counts
                    + np.float32(params.presence_penalty) * (self.counts > 0).astype(np.float32))
        if params.logit_bias:
            out += self.bias
        if self.matcher is not None:
            self._allowed = allowed if allowed is not None else self.allowed_tokens(out.size)
            out[~self._allowed] = -np.inf
        return torch.from_numpy(out)

    def allowed_tokens(self, size: int) -> np.ndarray:
        """The grammar's mask over `size` token ids for the next step (bool [size])."""
        allowed = np.zeros(size, dtype=np.bool_)
        failed_before = self.matcher.is_error()
        if not self.matcher.is_stopped() and not failed_before:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(size, bits.size)
            allowed[:n] = bits[:n].astype(np.bool_)
        if not failed_before and self.matcher.is_error():  # the mask itself hit a limit of llguidance's
            self._error = self.matcher.get_error()
        done = self.matcher.is_stopped() or self.matcher.is_error() or not allowed.any()
        allowed[self.eos] = done or self.matcher.is_accepting()
        return allowed

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a limit llguidance hit at run time: its mask failed,
        or it refused a token its own mask allowed), or None."""
        if self._error is None:
            return None
        return self._error.splitlines()[0][:300] if self._error.strip() else "the grammar failed"

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the grammar accepts (does not mutate: a
        draft's pre-check, memrad.engine.speculation); all of them where there is no grammar."""
        if self.matcher is None or not tokens:
            return len(tokens)
        return self.matcher.validate_tokens(list(tokens))

    @property
    def complete(self) -> bool:
        """The grammar is matched and allows nothing more (only end-of-sequence would follow)."""
        return self.matcher is not None and self.matcher.is_stopped() and not self.matcher.is_error()

    def accept(self, token: int) -> None:
        """`token` was chosen from the shaped logits (and is not end-of-sequence)."""
        self.counts[token] += 1.0
        self.seen[token] = True
        if self.matcher is not None and not self.matcher.consume_token(token):
            if self._allowed is None or self._allowed[token]:  # allowed, then refused: llguidance gave up
                self._error = self.matcher.get_error()
            # else a sampler that ignored the mask (tests' scripted models): the reply goes on unconstrained
            log.warning("the grammar refused token %d: %s", token, self.matcher.get_error()[:200])
