"""gpt-oss from a GGUF: the tensors transformers' GGUF loader cannot place, placed by memra.

transformers 5.24 reads gpt-oss's GGUF config wrongly (its rope keys fail) and maps no llama.cpp
tensor onto the experts' `gate_up_proj` or their biases, nor the sinks as llama.cpp names them
(tests/unit/test_gpt_oss.py pins it). So for a "gpt-oss" file memra builds the config from the
header itself (memrad.engine.model.preflight.gguf_config, its gpt-oss fields included), the
tokenizer with transformers' GGUF tokenizer reader (which needs no config), and fills every
parameter from the file's tensors, dequantised with gguf-py (MXFP4 included) as llama.cpp's
converter laid them out:

    llama.cpp (numpy shape)                       transformers' GptOssForCausalLM
    token_embd / output / output_norm             embed_tokens / lm_head / norm
    blk.N.attn_norm, post_attention_norm          input_layernorm, post_attention_layernorm
    blk.N.attn_{q,k,v,output}.weight, .bias       self_attn.{q,k,v,o}_proj.weight, .bias
    blk.N.attn_sinks.weight [H]                   self_attn.sinks
    blk.N.ffn_gate_inp.weight, .bias              mlp.router.weight, .bias
    blk.N.ffn_gate_exps.weight [E, I, H]          mlp.experts.gate_up_proj [E, H, 2I], even columns (transposed)
    blk.N.ffn_up_exps.weight   [E, I, H]                                              odd columns
    blk.N.ffn_down_exps.weight [E, H, I]          mlp.experts.down_proj [E, I, H] (transposed)
    blk.N.ffn_{gate,up}_exps.bias [E, I]          mlp.experts.gate_up_proj_bias [E, 2I], even / odd
    blk.N.ffn_down_exps.bias [E, H]               mlp.experts.down_proj_bias

The table is filled by memrad.engine.model.gguf_fill (shared with Gemma 4's reader): a file with
a tensor it does not name, a tensor of another shape, or a parameter no tensor fills is refused
(ModelUnavailable), so a layout memra does not know never loads as half-initialised weights.
The float32 model then goes through the same publish as every GGUF
(memrad.engine.model.pull.publish_converted: reload checked, block caches, marker); the block
caches keep the experts' MXFP4 bytes too, which decode runs on memra's block kernel
(memrad.engine.model.block_experts), and the Q8_0 attention's blocks.
"""

from __future__ import annotations

from memrad.engine.model.gguf_fill import ALL, Place, Table

ARCHITECTURE = "gpt-oss"  # general.architecture as llama.cpp writes it
WHY = "transformers' cannot read its experts"  # said as the conversion starts
_GATE, _UP = slice(0, None, 2), slice(1, None, 2)  # columns of the last dim
TABLE = Table(
    architecture=ARCHITECTURE,
    whole={"token_embd.weight": Place("model.embed_tokens.weight"), "output_norm.weight": Place("model.norm.weight"),
           "output.weight": Place("lm_head.weight")},
    layer={
        "attn_norm.weight": Place("input_layernorm.weight"),
        "post_attention_norm.weight": Place("post_attention_layernorm.weight"),
        **{f"attn_{short}.{part}": Place(f"self_attn.{proj}_proj.{part}")
           for short, proj in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for part in ("weight", "bias")},
        "attn_sinks.weight": Place("self_attn.sinks"),
        "ffn_gate_inp.weight": Place("mlp.router.weight"),
        "ffn_gate_inp.bias": Place("mlp.router.bias"),
        "ffn_gate_exps.weight": Place("mlp.experts.gate_up_proj", _GATE, True),
        "ffn_up_exps.weight": Place("mlp.experts.gate_up_proj", _UP, True),
        "ffn_down_exps.weight": Place("mlp.experts.down_proj", ALL, True),
        "ffn_gate_exps.bias": Place("mlp.experts.gate_up_proj_bias", _GATE),
        "ffn_up_exps.bias": Place("mlp.experts.gate_up_proj_bias", _UP),
        "ffn_down_exps.bias": Place("mlp.experts.down_proj_bias"),
    })

