"""Gemma 4 (text) from a GGUF: the layout transformers' GGUF loader does not read, read by memra.

transformers 5.24's loader reads a gemma4 header's widths and head counts but none of its layout
keys, so the config keeps its defaults and the weights do not fit it (tests/unit/test_gemma4_step.py
pins it). So for a "gemma4" file memra builds the config from the header itself (`config_fields`,
added by memrad.engine.model.preflight.gguf_config) as llama.cpp's converter (convert_hf_to_gguf.py,
Gemma4Model) writes it:

    llama.cpp's key or tensor                    Gemma4TextConfig
    attention.sliding_window_pattern [bool]      layer_types (true: sliding_attention)
    attention.shared_kv_layers                   num_kv_shared_layers
    embedding_length_per_layer_input             hidden_size_per_layer_input
    per_layer_token_embd.weight rows             vocab_size_per_layer_input
    attention.key_length / key_length_swa        global_head_dim / head_dim (value lengths: the same)
    attention.head_count_kv [per layer]          num_global_key_value_heads (full) / num_key_value_heads
    no blk.N.attn_v on a full layer              attention_k_eq_v (its keys are its values)
    rope.freq_base / rope.freq_base_swa          rope_parameters' full / sliding rope_theta
    rope_freqs [global_head_dim / 2]             the full layers' "proportional" rope: 1 for a turning
                                                 pair, 1e30 for a still one (partial_rotary_factor)
    feed_forward_length [per layer]              intermediate_size, doubled on KV-shared layers
                                                 (use_double_wide_mlp)
    final_logit_softcapping                      final_logit_softcapping
    expert_count / expert_used_count             num_experts / top_k_experts, enable_moe_block (a
    expert_feed_forward_length                   mixture of experts: 26B-A4B), moe_intermediate_size

and fills every parameter by `TABLE` (memrad.engine.model.gguf_fill): llama.cpp's Gemma 4 stores
the norms as they are (its converter's norm shift is 0, unlike Gemma 2 / 3's 1 + w), both
embeddings unscaled (the forward scales by sqrt(width) in both), the layer scalar as
`blk.N.layer_output_scale.weight`. A mixture-of-experts Gemma 4's router and experts, as the
converter names them (llama.cpp's src/models/gemma4.cpp reads them so):

    blk.N.ffn_gate_inp.weight [E, H]             router.proj.weight
    blk.N.ffn_gate_inp.scale [H]                 router.scale (the router's norm has no weight)
    blk.N.ffn_down_exps.scale [E]                router.per_expert_scale (llama.cpp scales each
                                                 expert's down output by it: the same product)
    blk.N.ffn_gate_up_exps.weight [E, 2I, H]     experts.gate_up_proj (as it is: gate rows, then up)
      or ffn_gate_exps, ffn_up_exps [E, I, H]    its first and second I rows
    blk.N.ffn_down_exps.weight [E, H, I]         experts.down_proj
    blk.N.pre_ffw_norm_2 / post_ffw_norm_1 / _2  pre_feedforward_layernorm_2 / post_feedforward_layernorm_1 / _2

llama.cpp lets a layer go without experts (no ffn_gate_inp); transformers' Gemma 4 has them in every
layer or none, so such a file leaves parameters unfilled and is refused by them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memrad.engine.model.gguf_fill import Place, Table
from memrad.engine.model.gguf_header import GGUFHeader, read_f32
from memrad.engine.model.unavailable import ModelUnavailable

ARCHITECTURE = "gemma4"  # general.architecture as llama.cpp writes it
WHY = "transformers' does not read its layout"  # said as the conversion starts
_STILL = 1e30  # rope_freqs' factor for a pair the proportional rope does not turn
TABLE = Table(
    architecture=ARCHITECTURE,
    whole={"token_embd.weight": Place("model.embed_tokens.weight"), "output_norm.weight": Place("model.norm.weight"),
           "output.weight": Place("lm_head.weight"),
           "per_layer_token_embd.weight": Place("model.embed_tokens_per_layer.weight"),
           "per_layer_model_proj.weight": Place("model.per_layer_model_projection.weight"),
           "per_layer_proj_norm.weight": Place("model.per_layer_projection_norm.weight")},
    layer={
        **{f"attn_{short}.weight": Place(f"self_attn.{proj}_proj.weight")
           for short, proj in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
        "attn_q_norm.weight": Place("self_attn.q_norm.weight"),
        "attn_k_norm.weight": Place("self_attn.k_norm.weight"),
        **{f"ffn_{part}.weight": Place(f"mlp.{part}_proj.weight") for part in ("gate", "up", "down")},
        "attn_norm.weight": Place("input_layernorm.weight"),
        "post_attention_norm.weight": Place("post_attention_layernorm.weight"),
        "ffn_norm.weight": Place("pre_feedforward_layernorm.weight"),
        "post_ffw_norm.weight": Place("post_feedforward_layernorm.weight"),
        "inp_gate.weight": Place("per_layer_input_gate.weight"),
        "proj.weight": Place("per_layer_projection.weight"),
        "post_norm.weight": Place("post_per_layer_input_norm.weight"),
        "layer_output_scale.weight": Place("layer_scalar"),
        "ffn_gate_inp.weight": Place("router.proj.weight"),
        "ffn_gate_inp.scale": Place("router.scale"),
        "ffn_down_exps.scale": Place("router.per_expert_scale"),
        "ffn_gate_up_exps.weight": Place("experts.gate_up_proj"),
        "ffn_gate_exps.weight": Place("experts.gate_up_proj", half=0),
        "ffn_up_exps.weight": Place("experts.gate_up_proj", half=1),
        "ffn_down_exps.weight": Place("experts.down_proj"),
        "pre_ffw_norm_2.weight": Place("pre_feedforward_layernorm_2.weight"),
        "post_ffw_norm_1.weight": Place("post_feedforward_layernorm_1.weight"),
        "post_ffw_norm_2.weight": Place("post_feedforward_layernorm_2.weight"),
    },
    layout=frozenset({"rope_freqs.weight"}))


def config_fields(header: GGUFHeader, path: Path) -> dict[str, Any]:
    """The Gemma4TextConfig fields of a gemma4 GGUF's layout (the table above); ModelUnavailable,
    naming the key, for a layout transformers' Gemma 4 cannot express."""
    pattern = header.arch_field("attention.sliding_window_pattern")
    if not isinstance(pattern, list):
        raise ModelUnavailable(f"{path} is a gemma4 GGUF without attention.sliding_window_pattern: memra cannot "
                               "tell its sliding-window layers from its full ones")
    kinds = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    tensors = {tensor.name: tensor for tensor in header.tensors}
    head_dim, global_head_dim = header.arch_field("attention.key_length_swa"), header.arch_field("attention.key_length")
    for key, keys in (("attention.value_length", global_head_dim), ("attention.value_length_swa", head_dim)):
        if header.arch_field(key, keys) != keys:
            raise ModelUnavailable(f"{path}: gemma4's {key} {header.arch_field(key)} differs from its key length "
                                   f"{keys}, which transformers' Gemma 4 cannot express")
    heads = header.arch_field("attention.head_count_kv")
    heads = heads if isinstance(heads, list) else [heads] * len(kinds)
    full = [layer for layer, kind in enumerate(kinds) if kind == "full_attention"]
    sliding = [layer for layer, kind in enumerate(kinds) if kind == "sliding_attention"]
    values = {"layer_types": kinds, "num_kv_shared_layers": header.arch_field("attention.shared_kv_layers", 0),
              "hidden_size_per_layer_input": header.arch_field("embedding_length_per_layer_input", 0),
              "head_dim": head_dim or global_head_dim, "global_head_dim": global_head_dim,
              "num_key_value_heads": heads[sliding[0] if sliding else 0],
              "num_global_key_value_heads": heads[full[0]] if full else None,
              "attention_k_eq_v": bool(full) and f"blk.{full[0]}.attn_v.weight" not in tensors,
              "final_logit_softcapping": header.arch_field("final_logit_softcapping"),
              "rope_parameters": _rope(header, path, tensors.get("rope_freqs.weight"), head_dim or global_head_dim)}
    embedding = tensors.get("per_layer_token_embd.weight")
    if embedding is not None:
        values["vocab_size_per_layer_input"] = embedding.shape[-1]
    widths = header.arch_field("feed_forward_length")
    if isinstance(widths, list):
        first_shared = len(kinds) - values["num_kv_shared_layers"]
        doubled = [widths[0] * (2 if layer >= first_shared else 1) for layer in range(len(kinds))]
        if widths != doubled and widths != [widths[0]] * len(kinds):
            raise ModelUnavailable(f"{path}: gemma4's feed_forward_length per layer {widths} is neither one width "
                                   "nor one doubled on the KV-shared layers (use_double_wide_mlp)")
        values.update(intermediate_size=widths[0], use_double_wide_mlp=widths != [widths[0]] * len(kinds))
    experts = header.arch_field("expert_count", 0)
    if experts:
        values.update(enable_moe_block=True, num_experts=experts, top_k_experts=header.arch_field("expert_used_count"),
                      moe_intermediate_size=header.arch_field("expert_feed_forward_length"))
    return {key: value for key, value in values.items() if value is not None}


def _rope(header: GGUFHeader, path: Path, freqs: Any, head_dim: int) -> dict[str, dict[str, Any]]:
    """Both kinds' rope: sliding layers the default rope (partial where rope.dimension_count_swa is
    under the head dim), full layers "proportional" where the file ships rope_freqs."""
    sliding = {"rope_type": "default", "rope_theta": float(header.arch_field("rope.freq_base_swa", 10_000.0))}
    turned = header.arch_field("rope.dimension_count_swa", head_dim)
    if turned != head_dim:
        sliding["partial_rotary_factor"] = turned / head_dim
    full = {"rope_type": "default", "rope_theta": float(header.arch_field("rope.freq_base", 1_000_000.0))}
    if freqs is not None:
        factors = read_f32(path, freqs)
        turning = factors.count(1.0)
        if not all(abs(factor / _STILL - 1) < 1e-6 for factor in factors[turning:]):  # 1e30 as an F32
            raise ModelUnavailable(f"{path}: gemma4's rope_freqs are not the proportional rope's (1 for a turning "
                                   f"pair, then {_STILL:g}): memra reads no other")
        full.update(rope_type="proportional", partial_rotary_factor=turning / len(factors))
    return {"sliding_attention": sliding, "full_attention": full}
