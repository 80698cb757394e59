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


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML control tokens <|im_start|>=1, <|im_end|>=2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_llama(vocab_size: int, seed: int = 0, max_positions: int = 1024) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def save_tiny_llama(folder: Path) -> Path:
    """Write a loadable Hugging Face folder (config, safetensors, tokenizer, template)."""
    tokenizer = build_tokenizer()
    model = build_llama(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
