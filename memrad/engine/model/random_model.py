"""A model folder shaped like another one, with random weights.

Prefill and decode cost depend on the architecture and the shapes, not on the weights'
values, so timing work (the benchmarks on a borrowed GPU, where the default model's weights
cannot be fetched) can run on a model built from the real config and tokenizer with freshly
initialised weights. Its replies are nonsense; reuse, exactness and TTFT behave as with the
real weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Everything of a Hugging Face model folder but its weights.
SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")

# Hybrid shapes whose real weights are too large for this machine (or not on it), scaled
# down: the real model's layer pattern, head dims, rope and routing, fewer and narrower
# layers and fewer experts. Qwen3-Next-80B-A3B: 48 layers (3 gated delta nets, then one
# gated full-attention layer, repeated), hidden 2048, attention 16 x 256 over 2 KV heads with
# a quarter of each head rotated, delta nets of 16 key / 32 value heads of 128, 512 experts
# (10 routed + 1 shared per token, 512 wide). Scaled: 12 layers of hidden 1024, 8 query
# heads, delta nets of 8 key / 16 value heads, 16 experts (4 routed + the shared one):
# ~520M parameters (most in the experts), ~250M of them run per token.
NAMED_SHAPES = {
    "qwen3-next": {
        "model_type": "qwen3_next", "hidden_size": 1024, "num_hidden_layers": 12, "full_attention_interval": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "intermediate_size": 3072,
        "norm_topk_prob": True, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    # A 0.5B-class FalconH1 (Falcon-H1-0.5B's widths as remembered from its published config;
    # not checked against the file, which this machine cannot fetch): 36 layers of Mamba-2 (24 heads of 64, state 128, one group)
    # beside attention (8 heads of 64 over 2 KV heads), hidden 1024, MLP 2048; muP multipliers
    # left at transformers' defaults (they cost nothing).
    "falcon-h1": {
        "model_type": "falcon_h1", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 36,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "mamba_d_ssm": 1536,
        "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
}


def copy_shape(source: Path, out: Path) -> list[str]:
    """Copy the config and tokenizer files of `source` into `out`; returns the names copied."""
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json: not a Hugging Face model folder")
    out.mkdir(parents=True, exist_ok=True)
    copied = [name for name in SHAPE_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, out / name)
    return copied


def write_random_model(shape: Path, out: Path, seed: int = 0) -> Path:
    """A loadable folder at `out`: `shape`'s config and tokenizer, weights drawn with `seed`,
    its linear layers rounded to Q4_1 blocks and its head to Q8_0, both kept as block caches,
    as the default model's GGUF ships them (so `--weights auto` runs the same kernels there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memrad.engine.model.weights import quantize_head_q8_0, quantize_layers_q4_1, write_int4_cache, write_q8_cache

    copy_shape(shape, out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    blocks, head = quantize_layers_q4_1(model), quantize_head_q8_0(model)
    model.save_pretrained(out)
    write_int4_cache(blocks, out, f"random Q4_1 (seed {seed})")
    write_q8_cache(head, out, f"random Q8_0 head (seed {seed})", "Q8_0")
    return out


def write_named_shape(name: str, tokenizer_folder: Path, out: Path, seed: int = 0) -> Path:
    """A loadable folder at `out`: the NAMED_SHAPES config `name` over the tokenizer (and chat
    template) of `tokenizer_folder`, random weights drawn with `seed`, kept in bfloat16 and
    float (no quantised blocks: the step's float kernels are what it measures)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name not in NAMED_SHAPES:
        raise ValueError(f"no shape named {name!r} (named: {', '.join(NAMED_SHAPES)})")
    copy_shape(tokenizer_folder, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    fields = dict(NAMED_SHAPES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    return out
