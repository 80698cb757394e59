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


def test_penalties_and_bias_follow_openai_and_vllm_and_leave_the_step_s_logits_alone():
    from memrad.engine.sampling import Shaper

    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                            logit_bias=((3, -100.0),))
    shaper = Shaper(params, prompt_ids=(1,), vocab_size=4, eos_ids={3})
    for token in (0, 0, 2):
        shaper.accept(token)
    shaped = shaper(logits)
    # 0: seen, 2.0 / 2 = 1.0, then 2 draws: - 0.5 * 2 - 0.25; 1: prompt token, -1.0 * 2; 2: 0.5 / 2 - 0.5 - 0.25
    assert shaped.tolist() == [1.0 - 1.0 - 0.25, -2.0, 0.25 - 0.5 - 0.25, 1.0 - 100.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 1.0]


def test_top_k_and_min_p_cut_the_tail_before_sampling():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, 2.8])
    for params, allowed in ((SamplingParams(temperature=1.0, top_k=2), {0, 1}),
                            (SamplingParams(temperature=1.0, min_p=0.5), {0, 1, 4}),
                            (SamplingParams(temperature=1.0, top_k=3, top_p=0.5), {0, 1})):
        draws = {sample(logits, params, make_generator(seed)) for seed in range(60)}
        assert draws == allowed, params


def test_seeded_sampling_with_every_field_reproduces():
    from memrad.engine.sampling import Shaper

    logits = torch.linspace(-2, 2, 64)
    params = SamplingParams(temperature=0.8, top_k=20, min_p=0.01, top_p=0.9, frequency_penalty=0.3,
                            presence_penalty=0.1, repetition_penalty=1.1, logit_bias=((63, -5.0),), seed=3)

    def run():
        shaper, generator, out = Shaper(params, (1, 2, 3), 64, {0}), make_generator(3), []
        for _ in range(12):
            out.append(sample(shaper(logits), params, generator))
            shaper.accept(out[-1])
        return out

    assert run() == run()
