"""Tiny randomly initialised models with an offline ChatML tokenizer: no download at all."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful coding assistant. Read the file, then answer.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Caches keep prefixes warm.",
    "user assistant system tool: run tests, list files, open README.md",
    "Übersetzung: naïve café, 東京, emoji 🙂 and accents é è ê",
] * 20


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('Only user and assistant roles are supported') }}{% elif m['role'] == 'user' %}"
    "[INST] {{ m['content'] }}[/INST]{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)
# style -> (special tokens, eos, bos, template, expected message openers)
STYLES = {
    "chatml": (SPECIALS, "<|im_end|>", None, CHATML, {"<|im_start|>"}),
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|eot_id|>", "<|begin_of_text|>", LLAMA3, {"<|start_header_id|>"}),
    "gemma": (["<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", "<bos>", GEMMA,
              {"<start_of_turn>"}),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "</s>", "<s>", MISTRAL, {"[INST]", "[/INST]"}),
}


def build_tokenizer(style: str = "chatml") -> PreTrainedTokenizerFast:
    """A byte-level BPE whose control tokens and chat template follow `style`.

    chatml (the default): <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, as in SmolLM2.
    """
    specials, eos, bos, template, _ = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                   pad_token=specials[0])
    fast.chat_template = template
    return fast


def build_llama(vocab_size: int, seed: int = 0, max_positions: int = 1024, tied: bool = False) -> LlamaForCausalLM:
    """`tied`: the head shares the input embedding's weight, as in SmolLM2."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def save_tiny_llama(folder: Path) -> Path:
    """Write a loadable Hugging Face folder (config, safetensors, tokenizer, template)."""
    return save_tiny(folder, "llama")


def _slow_decay(model) -> None:
    """Make recurrent state decay slowly, so a wrong or stale state changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-6.0)


def build_qwen3_next(vocab_size: int, seed: int = 0):
    """Gated DeltaNet (recurrent + conv state) layers beside full attention."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=1024, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = Qwen3NextForCausalLM(config).eval()
    _slow_decay(model)
    return model


def build_falcon_h1(vocab_size: int, seed: int = 0):
    """Mamba-2 and attention side by side in every layer (LinearAttentionAndFullAttentionLayer)."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    config = FalconH1Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, max_position_embeddings=1024,
        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = FalconH1ForCausalLM(config).eval()
    _slow_decay(model)
    return model


def build_gemma3(vocab_size: int, seed: int = 0, window: int = 8):
    """Gemma 3 (text): sliding-window layers of `window` tokens beside full attention, two rope
    bases, q/k norms, GeGLU; the +1 norm weights and the rope bases randomised so a step that
    dropped one would differ; the final logits soft-capped."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=window, max_position_embeddings=1024,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        final_logit_softcapping=30.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return model


# Gemma 4's tiny layout: sliding layers of 8 tokens around two global ones, the last two KV-shared
# (layer 4 reads layer 3's window, layer 5 layer 2's slab).
GEMMA4_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention"]


GEMMA4_EXPERTS = 8  # the tiny mixture-of-experts Gemma 4's


def build_gemma4(vocab_size: int, seed: int = 0, window: int = 8, experts: int = 0, width: int = 64):
    """Gemma 4 (text, Gemma4ForCausalLM) with every part its dense models have: per-layer inputs
    (P = 8), the last 2 layers reading earlier layers' KV, global layers of their own head dim (32
    against 16) with one KV head and keys as values (attention_k_eq_v), "proportional" rope on them
    (a quarter of the angles turn), v norms, layer scalars; the norm weights, layer scalars and
    rope bases off their defaults so a step that dropped one would differ; the final logits
    soft-capped. `experts` > 0: the mixture-of-experts Gemma 4 (26B-A4B's layout: enable_moe_block),
    that many experts of width 64, the top 2 a token, beside every layer's MLP; the router's scale
    and per-expert scales drawn off 1 too. `width`: the hidden size and the MLP's (256: the rows of
    q, k, v, gate, up, down and the per-layer projection whole k-quant super-blocks, as
    tests/unit/tiny_gguf.py's write_gemma4_gguf(kquants=True) needs; 64: the hidden size, an MLP of 128)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    config = Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width if width == 64 else width,
        num_hidden_layers=len(GEMMA4_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=window, max_position_embeddings=1024, layer_types=GEMMA4_LAYERS,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 500_000.0}},
        final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **(dict(enable_moe_block=True, num_experts=experts, top_k_experts=2, moe_intermediate_size=64)
           if experts else {}))
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "router.scale",
                              "router.per_expert_scale")):
                param.normal_(1.0, 0.3)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return model


# gpt-oss's layers alternate, sliding first, as the released models lay them out
GPT_OSS_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def build_gpt_oss(vocab_size: int, seed: int = 0, window: int = 8):
    """gpt-oss: sliding-window layers of `window` tokens alternating with full attention, a sink
    logit per head, q/k/v/o with biases, YaRN rope (factor 4 over a native 256: its attention
    factor is not 1), 8 experts of which 2 a token behind a router with a bias. Sinks drawn
    N(0, 1), every bias and norm weight random, so a step that dropped one would differ."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=len(GPT_OSS_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
        layer_types=GPT_OSS_LAYERS, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith(("bias", "_bias")):
                param.normal_(0.0, 0.02)
    return model


def save_tiny(folder: Path, kind: str) -> Path:
    """A loadable folder for `kind` in llama | llama-short | qwen3_next | falcon_h1 | gemma3 | gemma4
    | gemma4_moe | qwen3
    | starcoder2 | mamba | lfm2 (tests/unit/tiny_gguf.py's, float weights: short convolutions beside attention)
    | gpt_oss.
    llama-short: a native context of 64 tokens, for RoPE scaling past it, with sharp attention
    (q and k weights x8) so that positions move the logits well past rounding."""
    tokenizer = build_tokenizer()
    if kind == "llama":
        model = build_llama(len(tokenizer))
    elif kind == "llama-short":
        model = build_llama(len(tokenizer), max_positions=64)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
    elif kind == "qwen3_next":
        model = build_qwen3_next(len(tokenizer))
    elif kind == "falcon_h1":
        model = build_falcon_h1(len(tokenizer))
    elif kind == "gemma3":
        model = build_gemma3(len(tokenizer))
    elif kind == "gemma4":
        model = build_gemma4(len(tokenizer))
    elif kind == "gemma4_moe":
        model = build_gemma4(len(tokenizer), experts=GEMMA4_EXPERTS)
    elif kind == "gpt_oss":
        model = build_gpt_oss(len(tokenizer))
    elif kind == "starcoder2":  # LayerNorm and a plain (ungated) MLP: no decode step covers it
        from transformers import Starcoder2Config, Starcoder2ForCausalLM

        torch.manual_seed(0)
        model = Starcoder2ForCausalLM(Starcoder2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, sliding_window=None,
            eos_token_id=2, bos_token_id=1, pad_token_id=0)).eval()
    elif kind == "qwen3":  # dense, with per-head q/k norms (the llama-shaped step)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            eos_token_id=2, bos_token_id=1, pad_token_id=0)).eval()
    elif kind == "lfm2":
        from tiny_gguf import build

        model = build("lfm2", len(tokenizer))
    elif kind == "mamba":
        from transformers import MambaConfig, MambaForCausalLM

        model = MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2))
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_q4_folder(folder: Path, kind: str = "llama") -> Path:
    """The tiny llama (or `kind` "gemma3", "gemma4": the tiny Gemma 3, Gemma 4) shaped like SmolLM2's
    GGUF, as `memrad pull` leaves one: Q4_1 layers and a Q8_0 head tied to the embedding, their
    blocks kept beside the float weights."""
    from memrad.engine.model.weights import quantize_head_q8_0, quantize_layers_q4_1, write_int4_cache, write_q8_cache

    tokenizer = build_tokenizer()
    builds = {"gemma3": build_gemma3, "gemma4": build_gemma4}
    model = builds[kind](len(tokenizer)) if kind in builds else build_llama(len(tokenizer), tied=True)
    blocks, head = quantize_layers_q4_1(model), quantize_head_q8_0(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_int4_cache(blocks, folder, "test")
    write_q8_cache(head, folder, "test", "Q8_0")
    return folder


def write_tiny_gguf(path: Path, model) -> Path:
    """A GGUF holding what memra reads back from one (no tokenizer, so transformers cannot
    load it): a tied llama's embedding as Q8_0 `token_embd.weight`, as llama.cpp ships
    SmolLM2's head, and layer 0's V projection as Q4_1 (V: no row permutation)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(str(path), "llama")
    for name, weight, kind in (
        ("token_embd.weight", model.model.embed_tokens.weight, GGMLQuantizationType.Q8_0),
        ("blk.0.attn_v.weight", model.model.layers[0].self_attn.v_proj.weight, GGMLQuantizationType.Q4_1),
    ):
        raw = quants.quantize(weight.detach().float().numpy(), kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    return finish_gguf(writer, path)


def finish_gguf(writer, path: Path) -> Path:
    """Write out a GGUFWriter's header, fields and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
