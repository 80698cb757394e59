"""A prefill chunk's dense products in fixed spans (memrad.engine.model.products): the same bits
at 1 and 2 threads where torch's own product differs, within rounding of float64, the spans'
cut, which models get them and why, and the thread policy that follows: prefill adapts in
exact mode only where its products hold their bits at any count."""

import pytest
import torch
from torch.nn import functional as F
from transformers import FalconH1Config, Gemma3TextConfig, LlamaConfig, Qwen3MoeConfig, Qwen3NextConfig

from memrad.engine.engine import _team_policy, EngineOptions
from memrad.engine.kernels import sliced_linear
from memrad.engine.model.hardware import Choice
from memrad.engine.model.products import TORCH, Invariant, Products, attention_only, choose
from memrad.engine.team import PHASES
from tiny import build_llama

needs_kernel = pytest.mark.skipif(sliced_linear.load() is not None, reason="built with a C++ compiler")


def at_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_sliced_product_has_the_same_bits_at_1_and_2_threads(dtype):
    # the default model's down projection: torch's own bf16 product differs at 1 and 2 threads
    # on Sapphire Rapids (docs/BENCHMARKS.md, Shared machine)
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, 256, 1536).to(dtype), torch.randn(576, 1536).to(dtype), torch.randn(576).to(dtype)
    one, two = (at_threads(n, lambda: torch.ops.memra.sliced_linear(x, weight, bias, 2)) for n in (1, 2))
    assert one.shape == (1, 256, 576) and torch.equal(one, two)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert ((one.double() - expected).abs().max() / expected.abs().max()).item() < 2e-2
    # Each span is one product of its columns: the cut is by N and the slice count alone.
    span = 288
    assert torch.equal(one[..., :span], at_threads(1, lambda: F.linear(x, weight[:span], bias[:span])))


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 17, 100, 577])
def test_spans_cover_every_column_whatever_n(n):
    torch.manual_seed(n)
    x, weight = torch.randn(7, 64), torch.randn(n, 64)
    for slices in (1, 2, 3, 8):
        got = torch.ops.memra.sliced_linear(x, weight, None, slices)
        assert got.shape == (7, n)
        assert torch.allclose(got, F.linear(x, weight), atol=1e-4), (n, slices)


@needs_kernel
def test_a_tiny_models_prefill_under_the_spans_has_the_same_bits_at_1_and_2_threads():
    model = build_llama(300, seed=3, max_positions=512)
    ids = torch.randint(0, 300, (1, 96), generator=torch.Generator().manual_seed(1))

    def prefill():
        with torch.inference_mode(), Invariant(2):
            return model(input_ids=ids, use_cache=False).logits

    one, two = at_threads(1, prefill), at_threads(2, prefill)
    assert torch.equal(one, two)
    with torch.inference_mode():  # one row goes to torch's own product (decode's kernels hold their bits)
        with Invariant(2):
            single = model(input_ids=ids[:, :1], use_cache=False).logits
        assert torch.equal(single, model(input_ids=ids[:, :1], use_cache=False).logits)


def test_which_models_get_the_spans():
    assert attention_only(LlamaConfig())
    assert attention_only(Gemma3TextConfig())  # full and sliding-window attention layers
    assert not attention_only(Qwen3NextConfig())  # gated delta nets beside attention
    assert not attention_only(FalconH1Config())  # Mamba-2 heads in every layer
    assert not attention_only(Qwen3MoeConfig())  # experts' grouped products, not F.linear
    hybrid = choose(Qwen3NextConfig(), 2)
    assert hybrid.slices is None and hybrid.choice.value == "torch"
    assert hybrid.choice.reason.startswith("the model has non-attention layers or experts")


@needs_kernel
def test_an_attention_model_gets_spans_cut_by_the_cpus_it_may_run_on():
    assert choose(LlamaConfig(), 1) == Products(2, Choice("sliced x2", "dense products in 2 fixed column spans, "
                                                                       "one thread each: the same bits at any thread count"))
    assert choose(LlamaConfig(), 4).slices == 4


def test_exact_mode_adapts_prefill_only_where_its_products_hold_their_bits():
    options = EngineOptions(256, 2, mode="exact", adapt_threads=True)
    sliced = _team_policy(options, Products(2, Choice("sliced x2", "spans")))
    assert "prefill" not in sliced.steady
    kept = _team_policy(options, Products(None, Choice("torch", "no compiler")))
    assert kept.steady["prefill"] == ("exact mode keeps the count it started with: prefill products follow the "
                                      "count (no compiler), and a resumed prefill must give a cold one's bits")
    assert set(PHASES) - set(kept.steady) == {"decode", "batch"}
    assert _team_policy(EngineOptions(256, 2, mode="fast", adapt_threads=True), TORCH).steady == {}
