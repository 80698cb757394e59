"""Tiny random models written as GGUF files the way llama.cpp ships them, no hub involved.

`build(arch)` makes a tiny random transformers model per architecture, shaped so that every
linear weight's rows hold whole k-quant super-blocks (256 weights); `write_gguf` writes it with
the `gguf` package under llama.cpp's names and metadata (the inverse of what transformers' GGUF
loader reads: its config mapping, its tensor-name map, its per-architecture tensor processors),
the tokenizer of tests/unit/tiny.py included, so memra loads it through its own GGUF path
(memrad.engine.model.pull.pull_gguf). Quants as a Q4_K_M file mixes them: attention and
gate/up projections Q4_K, ffn_down Q6_K, the embedding (and untied head) Q8_0, norms F32.
gguf-py writes Q8_0 but not the k-quants, so Q4_K and Q6_K blocks are drawn at random; the
model's float weights are then set to what every block dequantizes to, so the written model
is exactly what the GGUF holds.

Unmapped config fields (transformers reads no key for them: Qwen3's head_dim, Gemma 2's soft-caps
and query_pre_attn_scalar, Qwen3-MoE's moe_intermediate_size) are left at the config class's
defaults, so they survive the trip.

LFM2's layout travels as llama.cpp's: one KV head count per layer (`head_count_kv`, 0 on a
short-convolution layer), the conv kernels [hidden, L] in F32.

Qwen3-MoE's experts are 3-D tensors as llama.cpp ships them (`ffn_gate_exps`, `ffn_up_exps`
[E, I, H], `ffn_down_exps` [E, H, I]; transformers joins gate and up into `gate_up_proj`
[E, 2I, H]), Q4_K / Q4_K / Q6_K; the router (`ffn_gate_inp`) F32, as llama.cpp keeps it.

gpt-oss is written apart (`write_gpt_oss_gguf`: transformers has no map of its tensors to
invert): tests/unit/tiny.py's tiny gpt-oss under llama.cpp's names, experts MXFP4 (gguf-py's
quantizer), attention and embeddings Q8_0, norms, biases, sinks and router F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T, GGUFWriter, quants

from tiny import build_tokenizer, finish_gguf

ARCHITECTURES = ("qwen3", "phi3", "gemma2", "qwen3_moe", "lfm2")
# LFM2's layers: short convolutions first and around the attention, as LiquidAI's models are laid out
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]
# transformers' model_type -> llama.cpp's architecture name, where they differ
_GGUF_ARCH = {"qwen3_moe": "qwen3moe"}
_ROW_SCALE = 0.02  # the size of a weight, as transformers' random init draws them


def build(arch: str, vocab_size: int, seed: int = 0):
    """A tiny random model of `arch` (hidden 256: attention rows are whole super-blocks)."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Lfm2Config, Lfm2ForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":  # head_dim stays the default 128 (no GGUF key carries it)
        model = Qwen3ForCausalLM(Qwen3Config(**common, num_attention_heads=2, num_key_value_heads=1))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**common, num_attention_heads=4, num_key_value_heads=2))
    elif arch == "gemma2":  # soft-caps 50 / 30 and query_pre_attn_scalar 256: the defaults
        model = Gemma2ForCausalLM(Gemma2Config(**{**common, "num_hidden_layers": 4}, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=64, sliding_window=8))
    elif arch == "qwen3_moe":  # 8 experts of moe_intermediate_size 768 (the default), 2 per token
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_attention_heads=2, num_key_value_heads=1,
                                                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True))
    elif arch == "lfm2":  # the feed-forward width as the GGUF carries it (transformers' loader: no auto-adjust)
        model = Lfm2ForCausalLM(Lfm2Config(**{**common, "num_hidden_layers": len(LFM2_LAYERS)}, num_attention_heads=4,
                                           num_key_value_heads=2, layer_types=LFM2_LAYERS,
                                           block_auto_adjust_ff_dim=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):  # random, so a step that dropped one would differ
                param.normal_(1.0 if arch != "gemma2" else 0.0, 0.3)
    return model.eval()


def kind_for(gguf_name: str, shape: tuple[int, ...]) -> T:
    """The GGUF type a Q4_K_M file gives the tensor."""
    if len(shape) == 1 or ".ffn_gate_inp" in gguf_name or ".shortconv.conv" in gguf_name:  # norms; the MoE
        return T.F32                                          # router; LFM2's conv kernels [hidden, L]
    if gguf_name.startswith(("token_embd", "output.")):
        return T.Q8_0
    if ".ffn_down" in gguf_name:
        return T.Q6_K
    return T.Q4_K


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K bytes [rows, cols/256 * 144] (fp16 d, dmin; 6-bit sc, m in 12 bytes; 4-bit codes)."""
    n = rows * cols // 256
    d = (rng.random(n) * _ROW_SCALE / 200).astype(np.float16)
    dmin = (rng.random(n) * _ROW_SCALE / 100).astype(np.float16)
    sc, m = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def random_q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q6_K bytes [rows, cols/256 * 210] (ql 128, qh 64, int8 scales 16, fp16 d)."""
    n = rows * cols // 256
    low_high = rng.integers(0, 256, (n, 192), dtype=np.uint8)
    scales = rng.integers(-32, 32, (n, 16), dtype=np.int8).view(np.uint8)
    d = (rng.random(n) * _ROW_SCALE / (32 * 32)).astype(np.float16)
    blocks = np.concatenate([low_high, scales, d.view(np.uint8).reshape(n, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


def random_q5_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q5_K bytes [rows, cols/256 * 176]: Q4_K's d, dmin, scales and codes with the codes' fifth
    bits (qh[32]: bit j of byte l is weight l of block j's) between scales and codes."""
    q4 = random_q4_k(rows, cols, rng).reshape(-1, 144)
    qh = rng.integers(0, 256, (q4.shape[0], 32), dtype=np.uint8)
    return np.concatenate([q4[:, :16], qh, q4[:, 16:]], axis=1).reshape(rows, cols // 256 * 176)


def _encode(weight: np.ndarray, kind: T, rng: np.random.Generator) -> np.ndarray:
    if kind == T.Q4_K:
        return random_q4_k(*weight.shape, rng)
    if kind == T.Q5_K:
        return random_q5_k(*weight.shape, rng)
    if kind == T.Q6_K:
        return random_q6_k(*weight.shape, rng)
    return quants.quantize(weight, kind)


def write_gguf(path: Path, model, tokenizer, seed: int = 0, kinds=kind_for) -> Path:
    """Write `model` (from `build`) and `tokenizer` as a GGUF at `path`, each tensor of the type
    `kinds(gguf name, shape)` gives (Q4_K_M's by default); sets the model's float weights to what
    the GGUF's blocks dequantize to (mutates `model`)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    config = model.config
    arch = config.model_type
    gguf_arch = _GGUF_ARCH.get(arch, arch)
    writer = GGUFWriter(str(path), gguf_arch)
    writer.add_name(f"tiny-{arch}")
    for key, attribute in GGUF_CONFIG_MAPPING[arch].items():
        value = getattr(config, attribute, None) if attribute not in (None, -1) else None
        if attribute == "rope_theta":  # transformers 5 keeps it in rope_parameters
            value = float(config.rope_parameters["rope_theta"])
        if attribute == "rms_norm_eps" and value is None:  # LFM2 names it norm_eps
            value = config.norm_eps
        if isinstance(value, bool) or value is None:
            continue
        full = f"{gguf_arch}.{key}"
        if arch == "lfm2" and key == "attention.head_count_kv":  # per layer, 0 on a conv layer: the layout
            writer.add_array(full, [value if kind == "full_attention" else 0 for kind in config.layer_types])
            continue
        if isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
    if getattr(config, "moe_intermediate_size", None):  # llama.cpp reads it; transformers does not
        writer.add_uint32(f"{gguf_arch}.expert_feed_forward_length", config.moe_intermediate_size)
    _write_tokenizer(writer, tokenizer)
    rng = np.random.default_rng(seed)
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor) if arch.endswith("_moe") else TensorProcessor
    params = dict(model.named_parameters())
    for gguf_name, hf_name in get_gguf_hf_weights_map(model, processor()).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = params[hf_name].detach()  # a view: what the GGUF tensor becomes in the model
        if ".ffn_gate_exps" in gguf_name or ".ffn_up_exps" in gguf_name:  # gate_up_proj [E, 2I, H]: gate, then up
            half = target.shape[1] // 2
            target = target[:, :half] if ".ffn_gate_exps" in gguf_name else target[:, half:]
        if ".shortconv.conv" in gguf_name:  # [hidden, 1, L] as llama.cpp ships it: [hidden, L]
            target = target.squeeze(1)
        stored = target.float().numpy()
        gemma_norm = arch.startswith("gemma") and "norm.weight" in hf_name  # llama.cpp stores 1 + w
        if gemma_norm:
            stored = stored + 1.0
        kind = kinds(gguf_name, stored.shape)
        raw = _encode(stored.reshape(-1, stored.shape[-1]), kind, rng).reshape(*stored.shape[:-1], -1)
        back = quants.dequantize(raw, kind).reshape(stored.shape)
        target.copy_(torch.from_numpy((back - 1.0 if gemma_norm else back).astype(np.float32)))
        name = gguf_name if gguf_name.endswith((".weight", ".bias")) else f"{gguf_name}.weight"  # the 3-D experts
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    return finish_gguf(writer, path)


def _write_tokenizer(writer: GGUFWriter, tokenizer) -> None:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = set(tokenizer.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_unk_token_id(tokenizer.pad_token_id)  # Gemma's tokenizer class needs one
    writer.add_chat_template(tokenizer.chat_template)


def tiny_gguf(folder: Path, arch: str, kinds=kind_for) -> tuple[Path, object]:
    """(the GGUF of a tiny `arch` model in `folder`, its tensors of the types `kinds` gives, that
    model with the GGUF's weights)."""
    tokenizer = build_tokenizer()
    model = build(arch, len(tokenizer))
    return write_gguf(folder / f"tiny-{arch}.gguf", model, tokenizer, kinds=kinds), model


def write_gemma4_gguf(path: Path, model, tokenizer, extra: tuple = (), split_experts: bool = False,
                      drop: tuple = (), kquants: bool = False) -> Path:
    """The tiny Gemma 4 of tests/unit/tiny.py (`build_gemma4`) as llama.cpp's converter
    (convert_hf_to_gguf.py, Gemma4Model) lays a gemma4 GGUF out: the fields transformers' loader
    reads and the layout keys it does not (sliding-window pattern, KV-shared layers, per-layer input
    width, both kinds' key and value lengths, KV heads per layer, both rope bases and rotary widths,
    the final soft-cap), the full layers' proportional rope as a `rope_freqs` tensor (1 for a pair
    that turns, 1e30 for one that does not); transformers' tensor names mapped by its own map (they
    are llama.cpp's), the layer scalar as `layer_output_scale.weight`, norms unshifted (llama.cpp's
    Gemma 4 norm shift is 0) and embeddings unscaled. Matrices whose rows are whole Q8_0 blocks
    (32 weights) Q8_0, the rest F32; the model's weights are set to what every tensor dequantizes
    to (mutates `model`), so the written model is exactly what the GGUF holds. Its widths are not
    whole k-quant super-blocks. `extra`: (name, float array) tensors written F32 besides (a layout
    memra's reader refuses). A mixture of experts (build_gemma4(experts=8)) as the converter's
    Gemma4Model writes it: expert_count, expert_used_count, expert_feed_forward_length; the router's
    `proj` as ffn_gate_inp.weight, its `scale` as ffn_gate_inp.scale, its per_expert_scale as
    ffn_down_exps.scale; the experts' 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I] as they are
    (ffn_gate_up_exps, ffn_down_exps), Q8_0; `split_experts`: gate_up as ffn_gate_exps and ffn_up_exps
    (its first and second I rows), as older files ship them. `drop`: prefixes of tensor names left out
    (a layer without experts, as llama.cpp allows). `kquants`: as a Q4_K_M file mixes them, every
    layer matrix whose rows are whole super-blocks (256 weights: build_gemma4(width=256)) Q4_K,
    ffn_down Q6_K, drawn at random (`kind_for`, `_encode`); the embeddings and the rest as above."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config, arch = model.config, "gemma4"
    layers = config.per_layer_config
    sliding = config.layer_types.index("sliding_attention")
    full = config.layer_types.index("full_attention")
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-gemma4")
    for key, value in (("context_length", config.max_position_embeddings), ("block_count", config.num_hidden_layers),
                       ("feed_forward_length", config.intermediate_size), ("embedding_length", config.hidden_size),
                       ("attention.key_length", layers[full].head_dim),
                       ("attention.value_length", layers[full].head_dim),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.sliding_window", config.sliding_window), ("vocab_size", config.vocab_size),
                       ("rope.dimension_count", layers[full].head_dim)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_head_count_kv([layers[layer].num_key_value_heads for layer in range(config.num_hidden_layers)])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_key_length_swa(layers[sliding].head_dim)
    writer.add_value_length_swa(layers[sliding].head_dim)
    writer.add_rope_dimension_count_swa(layers[sliding].head_dim)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    _write_tokenizer(writer, tokenizer)
    pairs = layers[full].head_dim // 2
    turning = int(pairs * config.rope_parameters["full_attention"]["partial_rotary_factor"])
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (pairs - turning), dtype=np.float32))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    named = [(gguf_name if gguf_name.endswith(".weight") else f"{gguf_name}.weight", tensors[hf_name])  # layer_output_scale
             for gguf_name, hf_name in get_gguf_hf_weights_map(model, TensorProcessor()).items()
             if not (hf_name == "lm_head.weight" and config.tie_word_embeddings)]
    for i, layer in enumerate(model.model.layers if config.enable_moe_block else ()):  # not in transformers' map
        named += [(f"blk.{i}.ffn_gate_inp.scale", layer.router.scale),
                  (f"blk.{i}.ffn_down_exps.scale", layer.router.per_expert_scale)]
    if split_experts:
        named = [split for name, target in named for split in (
            [(name.replace("gate_up", "gate"), target.chunk(2, dim=-2)[0]),
             (name.replace("gate_up", "up"), target.chunk(2, dim=-2)[1])] if "ffn_gate_up_exps" in name
            else [(name, target)])]
    for name, target in named:
        if name.startswith(drop):
            continue
        target = target.detach()
        kind = T.Q8_0 if target.dim() in (2, 3) and target.shape[-1] % 32 == 0 else T.F32
        if kquants and kind == T.Q8_0 and name.startswith("blk.") and target.shape[-1] % 256 == 0:
            kind = kind_for(name, tuple(target.shape))
        stored = target.float().numpy()  # the 3-D experts' matrices one after another: [E * rows, cols]
        raw = _encode(stored.reshape(-1, stored.shape[-1]), kind, np.random.default_rng(0)).reshape(
            *stored.shape[:-1], -1)
        target.copy_(torch.from_numpy(quants.dequantize(raw, kind).reshape(target.shape)))
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    for name, values in extra:
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    return finish_gguf(writer, path)


def gpt_oss_tensors(model) -> list[tuple[str, torch.Tensor, T]]:
    """(llama.cpp's name, the model's tensor as llama.cpp ships it, its GGUF type) for a tiny
    gpt-oss (tests/unit/tiny.py: build_gpt_oss), as llama.cpp's converter lays it out: the experts'
    gate and up (interleaved columns of `gate_up_proj` [E, H, 2I]) apart as [E, I, H] rows,
    `down_proj` [E, I, H] as [E, H, I], their biases split alike; the sinks as `attn_sinks.weight`.
    Experts MXFP4, attention and embeddings Q8_0, norms, biases, sinks and router F32."""
    out = [("token_embd.weight", model.model.embed_tokens.weight, T.Q8_0),
           ("output_norm.weight", model.model.norm.weight, T.F32), ("output.weight", model.lm_head.weight, T.Q8_0)]
    for i, layer in enumerate(model.model.layers):
        attention, experts = layer.self_attn, layer.mlp.experts
        out += [(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, T.F32),
                (f"blk.{i}.post_attention_norm.weight", layer.post_attention_layernorm.weight, T.F32),
                (f"blk.{i}.attn_sinks.weight", attention.sinks, T.F32),
                (f"blk.{i}.ffn_gate_inp.weight", layer.mlp.router.weight, T.F32),
                (f"blk.{i}.ffn_gate_inp.bias", layer.mlp.router.bias, T.F32)]
        for short, proj in (("q", attention.q_proj), ("k", attention.k_proj), ("v", attention.v_proj),
                            ("output", attention.o_proj)):
            out += [(f"blk.{i}.attn_{short}.weight", proj.weight, T.Q8_0),
                    (f"blk.{i}.attn_{short}.bias", proj.bias, T.F32)]
        gate_up, gate_up_bias = experts.gate_up_proj, experts.gate_up_proj_bias  # [E, H, 2I], [E, 2I]
        out += [(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :, ::2].transpose(1, 2), T.MXFP4),
                (f"blk.{i}.ffn_up_exps.weight", gate_up[:, :, 1::2].transpose(1, 2), T.MXFP4),
                (f"blk.{i}.ffn_down_exps.weight", experts.down_proj.transpose(1, 2), T.MXFP4),
                (f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[:, ::2], T.F32),
                (f"blk.{i}.ffn_up_exps.bias", gate_up_bias[:, 1::2], T.F32),
                (f"blk.{i}.ffn_down_exps.bias", experts.down_proj_bias, T.F32)]
    return out


def write_gpt_oss_gguf(path: Path, model, tokenizer, tensors: list | None = None) -> Path:
    """Write a tiny gpt-oss (tests/unit/tiny.py: build_gpt_oss) as llama.cpp's converter does:
    its metadata (key and value lengths, sliding window, YaRN's factor and native length) and
    `gpt_oss_tensors`, MXFP4 quantised with gguf-py's quantizer; sets the model's float weights
    to what every block dequantizes to (mutates `model`), so the written model is the GGUF's.
    `tensors`: others than `gpt_oss_tensors(model)` (a layout memra's reader refuses)."""
    config, arch = model.config, "gpt-oss"
    rope = config.rope_parameters
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-gpt-oss")
    for key, value in (("context_length", config.max_position_embeddings), ("embedding_length", config.hidden_size),
                       ("block_count", config.num_hidden_layers), ("feed_forward_length", config.intermediate_size),
                       ("expert_feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads),
                       ("attention.key_length", config.head_dim), ("attention.value_length", config.head_dim),
                       ("rope.dimension_count", config.head_dim), ("expert_count", config.num_local_experts),
                       ("expert_used_count", config.num_experts_per_tok),
                       ("attention.sliding_window", config.sliding_window),
                       ("rope.scaling.original_context_length", rope["original_max_position_embeddings"])):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", float(rope["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    writer.add_float32(f"{arch}.rope.scaling.factor", float(rope["factor"]))
    _write_tokenizer(writer, tokenizer)
    for name, tensor, kind in tensors or gpt_oss_tensors(model):
        stored = tensor.detach().float().numpy()
        if kind == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(stored))
            continue
        raw = quants.quantize(np.ascontiguousarray(stored), kind)  # [.., row bytes] uint8
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(quants.dequantize(raw, kind).reshape(stored.shape)))  # views write through
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    return finish_gguf(writer, path)


def tiny_gpt_oss_gguf(folder: Path) -> tuple[Path, object]:
    """(the GGUF of the tiny gpt-oss in `folder`, that model with the GGUF's weights)."""
    from tiny import build_gpt_oss

    tokenizer = build_tokenizer()
    model = build_gpt_oss(len(tokenizer))
    return write_gpt_oss_gguf(folder / "tiny-gpt-oss.gguf", model, tokenizer), model
