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
