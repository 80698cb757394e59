"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top_p) sampling.

Sampling runs on the CPU with a per-request generator so a given seed reproduces the same
tokens on any device.
"""

from __future__ import annotations

import secrets

import torch

from memrad.request import SamplingParams


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
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = (cumulative - sorted_probs) < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
