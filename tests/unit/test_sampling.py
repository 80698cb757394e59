"""Sampling edge cases the fuzzer found."""

import torch

from memrad.engine.sampling import make_generator, sample
from memrad.request import SamplingParams


def test_a_vanishing_temperature_samples_the_argmax_instead_of_raising():
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    for temperature, top_p in ((1e-300, 1.0), (1e-300, 0.5), (1e-45, 1.0)):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=0, max_tokens=1, stop=())
        assert sample(logits, params, make_generator(0)) == 1
    negative = torch.tensor([-5.0, -1.0, -3.0])  # logits / T overflow to -inf everywhere
    params = SamplingParams(temperature=1e-300, top_p=1.0, seed=0, max_tokens=1, stop=())
    assert sample(negative, params, make_generator(0)) == 1


def test_ordinary_temperatures_still_sample_by_seed():
    logits = torch.linspace(-1, 1, 50)
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=7, max_tokens=1, stop=())
    draws = [sample(logits, params, make_generator(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    assert len({sample(logits, params, make_generator(s)) for s in range(20)}) > 3
