"""The decode step against transformers' forward, per architecture, on tiny random configs.

What a step saves is the forward's work outside the kernels (masks, cache hooks, dispatch per
layer), so a tiny config, where the kernels cost least, shows it most plainly; real shapes
dilute it by their weights' bytes. Each architecture is timed on the same random model, the
same cache kind (memra's in-place slabs and windows) and the same tokens: the eager step's feed
against `decode_one_token` (transformers' forward), one thread, median of `steps` steps after
a 40-token prompt. `memrad bench arch-steps` prints it (docs/BENCHMARKS.md, Architectures).
For a mixture of experts it also counts the feed-forward bytes a token reads: the router and
its top k experts, against every expert (memrad.engine.decode.steps.experts.bytes_per_token).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

# The shapes of tests/unit/tiny_gguf.py (rows of whole k-quant super-blocks), llama for scale.
_COMMON = dict(vocab_size=400, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
               max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_GEMMA4 = dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
               num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, num_kv_shared_layers=2,
               hidden_size_per_layer_input=64, vocab_size_per_layer_input=400, final_logit_softcapping=30.0,
               layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                            "sliding_attention", "full_attention"])
SHAPES = {
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1)),
    "phi3": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2)),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              sliding_window=8)),
    "qwen3_moe": ("qwen3_moe", dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True)),  # experts of 768 (the default moe_intermediate_size)
    # Gemma 4's layout as tests/unit/tiny.py's tiny Gemma 4 (the last two layers KV-shared), at these widths
    "gemma4": ("gemma4_text", _GEMMA4),
    # and its mixture of experts (26B-A4B's layout): 8 experts of 128 beside every layer's MLP, top 2
    "gemma4_moe": ("gemma4_text", dict(**_GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                       moe_intermediate_size=128)),
    # LFM2's layout as tests/unit/tiny_gguf.py writes it: short convolutions around two attention layers
    "lfm2": ("lfm2", dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                          block_auto_adjust_ff_dim=False,
                          layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"])),
    # gpt-oss as tests/unit/tiny.py lays it out (sliding first, window 8), at these widths
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                sliding_window=8, num_local_experts=8, num_experts_per_tok=2,
                                layer_types=["sliding_attention", "full_attention"] * 2)),
}
PROMPT = list(range(5, 45))


@dataclass(frozen=True, slots=True)
class StepSpeed:
    arch: str
    step: str  # memrad.engine.decode.steps.describe's value
    dtype: str
    steps: int
    step_ms: float  # median ms a token, the step's feed
    forward_ms: float  # median ms a token, transformers' forward
    ffn_bytes: tuple[int, int] | None = None  # MoE: (feed-forward bytes a token reads, reading every expert)

    @property
    def ratio(self) -> float:
        return self.forward_ms / self.step_ms


def tiny_model(arch: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = SHAPES[arch]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **shape})
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def measure(arch: str, dtype_name: str = "bfloat16", steps: int = 64, threads: int = 1) -> StepSpeed:
    """`arch`'s tiny model (SHAPES) in `dtype_name` ("bfloat16" or "float32") timed on its step and
    on transformers' forward."""
    from transformers import DynamicCache

    from memrad.engine.decode import steps as step_table
    from memrad.engine.decode.decoder import Decoder
    from memrad.engine.decode.steps import experts
    from memrad.engine.forward import decode_one_token, prefill
    from memrad.engine.model import kv_dtype
    from memrad.engine.state.layers import install

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model = tiny_model(arch, dtype)
    context = len(PROMPT) + steps + 1
    feed = Decoder(model, context, torch.device("cpu")).feeder()
    timings = {}
    for name, run in (("step", feed), ("forward", lambda c, t, p: decode_one_token(model, c, t, p))):
        cache = install(DynamicCache(config=model.config), context, kv_dtype.of(model))
        with torch.inference_mode():
            logits = prefill(model, cache, PROMPT, 0, 16)
            times = []
            for offset in range(steps):
                token = int(logits.argmax())
                started = time.perf_counter()
                logits = run(cache, token, len(PROMPT) + offset)
                times.append(time.perf_counter() - started)
        timings[name] = statistics.median(times[4:]) * 1e3  # the first steps warm the allocator
    return StepSpeed(arch, step_table.describe(model, context).value, str(dtype).removeprefix("torch."), steps,
                     timings["step"], timings["forward"],
                     experts.bytes_per_token(model) if experts.has_experts(model) else None)
