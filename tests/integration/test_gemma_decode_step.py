"""Gemma 3 270M on memra's decode step: the eager and the compiled (AOTInductor, memra's attention
kernel over the sliding layers' window views) steps are chosen, and from a prompt longer than
the 512-token window they decode, greedily, the 32 tokens transformers' forward decodes (fp32).

Needs `memrad pull gemma3-270m` once; skipped until then, since tests never download weights.
The compiled step's package is built once per machine into the tests' compile cache
(minutes), then opened in a fraction of a second."""

import pytest
import torch
from transformers import DynamicCache

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode.decoder import Decoder
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from test_gemma_boundaries import gemma_loaded  # noqa: F401 (the fixture: float32, 2 threads)

pytestmark = pytest.mark.integration

CHUNK = 256
STEPS = 32


@pytest.fixture(scope="module")
def prompt(gemma_loaded):
    text = "".join(f"def add_{i}(a, b):\n    return a + b + {i}\n\n" for i in range(60))
    ids = gemma_loaded.tokenizer(text)["input_ids"]
    assert len(ids) > 600  # past the sliding window (512) before the first step
    return ids


@pytest.fixture(scope="module")
def transformers_tokens(gemma_loaded, prompt):
    cache = DynamicCache(config=gemma_loaded.model.config)
    logits = prefill(gemma_loaded.model, cache, prompt, 0, CHUNK)
    tokens = []
    for step in range(STEPS):
        tokens.append(int(logits.argmax()))
        logits = decode_one_token(gemma_loaded.model, cache, tokens[-1], len(prompt) + step)
    return tokens


def greedy(loaded, feed, prompt):
    cache = Engine(loaded, EngineOptions(CHUNK, 2)).new_cache()
    logits = prefill(loaded.model, cache, prompt, 0, CHUNK)
    tokens = []
    for step in range(STEPS):
        tokens.append(int(logits.argmax()))
        logits = feed(cache, tokens[-1], len(prompt) + step)
    return tokens


def test_the_eager_gemma_step_decodes_transformers_tokens(gemma_loaded, prompt, transformers_tokens):
    chosen = Decoder(gemma_loaded.model, gemma_loaded.context_len, gemma_loaded.device, "off")
    assert (chosen.choice.value, chosen.choice.reason) == ("eager", "compile = off: memra's attention kernel")
    assert greedy(gemma_loaded, chosen.feeder(), prompt) == transformers_tokens


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_gemma_step_is_chosen_and_decodes_transformers_tokens(gemma_loaded, prompt, transformers_tokens):
    chosen = Decoder(gemma_loaded.model, gemma_loaded.context_len, gemma_loaded.device, "on")
    chosen.start()
    assert chosen.choice.value == "compiled", chosen.choice.reason
    assert chosen.choice.reason.startswith("compile = on: AOTInductor") and "memra's attention kernel" in chosen.choice.reason
    assert greedy(gemma_loaded, chosen.feeder(), prompt) == transformers_tokens
