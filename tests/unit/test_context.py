"""The served context: native up to the model's length, RoPE scaling past it, on every path.

A tiny llama trained (configured) for 64 positions is served at 256: memra's prefill on the
grid and its decode step reproduce transformers' own forward built with the same YaRN rope
parameters, at positions past the native 64, and both differ from the unscaled model there
(so the comparison can fail). A session primed under one scaling is never resumed from disk
under another, and a resumed turn past the native length equals its cold run bit for bit.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode.decoder import Decoder
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import prefill
from memrad.engine.model import context as served_context
from memrad.engine.model.loader import load_model
from memrad.engine.model.pull import ModelUnavailable
from memrad.engine.state.disk import state_format
from stories import ask, make_engine

NATIVE, SERVED = 64, 256
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": NATIVE}
TOKENS = [5 + (i * 37) % 300 for i in range(200)]  # 200 positions, well past the native 64


def llama_config(**rope) -> LlamaConfig:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=NATIVE)
    if rope:
        config.rope_parameters = {"rope_theta": 10000.0, **rope}
    return config


def test_up_to_the_native_length_the_context_only_sizes_the_cache():
    config = llama_config()
    served = served_context.plan(config, 48)
    assert (served.num_tokens, served.scaling, served.factor, served.describe()) == (48, "native", 1.0, "native")
    assert served.reason() == "48 tokens, within the model's native 64"
    served_context.apply(config, served)
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    assert served_context.plan(config, 0) == served_context.ServedContext(NATIVE, NATIVE, "native", 1.0)


def test_past_the_native_length_plain_rope_becomes_yarn():
    config = llama_config()
    served = served_context.plan(config, SERVED)
    assert (served.scaling, served.factor, served.describe()) == ("yarn", 4.0, "yarn x4")
    assert served.reason().startswith("256 tokens: yarn RoPE scaling x4 over the native 64")
    served_context.apply(config, served)
    assert config.rope_parameters == YARN
    assert config.max_position_embeddings == SERVED


def test_the_catalog_default_applies_when_nothing_is_requested_and_a_request_beats_it():
    assert served_context.plan(llama_config(), 0, default=128).num_tokens == 128
    assert served_context.plan(llama_config(), 32, default=128).num_tokens == 32


def test_linear_scaling_stays_linear_and_other_rope_types_are_refused_past_their_length():
    config = llama_config(rope_type="linear", factor=2.0)
    served = served_context.plan(config, SERVED)
    assert served.describe() == "linear x4"
    served_context.apply(config, served)
    assert config.rope_parameters["factor"] == 8.0 and config.rope_parameters["rope_type"] == "linear"
    llama3 = llama_config(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)
    with pytest.raises(ModelUnavailable, match="rope is 'llama3', which memrad does not extend: serve at most "
                                               "its native 64 tokens"):
        served_context.plan(llama3, SERVED)
    assert served_context.plan(llama3, NATIVE).scaling == "native"


def test_layered_rope_scales_the_full_attention_layers_only():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(max_position_embeddings=NATIVE)
    sliding_before = dict(config.rope_parameters["sliding_attention"])
    served_context.apply(config, served_context.plan(config, SERVED))
    assert config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert config.rope_parameters["full_attention"]["factor"] == 4.0
    assert config.rope_parameters["sliding_attention"] == sliding_before


@pytest.fixture(scope="module")
def short_dir(tiny_dir):
    return tiny_dir("llama-short")


def reference(folder, dtype, rope):
    """transformers' own model from the same folder, with the rope parameters set by hand."""
    config = AutoConfig.from_pretrained(folder)
    if rope is not None:
        config.rope_parameters = rope
        config.max_position_embeddings = SERVED
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype).eval()


@torch.inference_mode()
def whole_forward(model, tokens):
    return model(input_ids=torch.tensor([tokens])).logits[0].float()  # [T, V]


# bf16: a few units in the last place of logits near 0.5 (one is 2**-9)
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.01)])
def test_scaled_prefill_and_decode_match_transformers_forward_with_the_same_rope(short_dir, dtype, atol):
    torch.set_num_threads(1)
    # The rows in the activations' dtype: the reference's (bf16 rows under fp32: test_kv_dtype)
    loaded = load_model(str(short_dir), device="cpu", dtype=dtype, context=SERVED, kv_dtype="activations")
    assert (loaded.context_len, loaded.context.describe()) == (SERVED, "yarn x4")
    torch_dtype = getattr(torch, dtype)
    expected = whole_forward(reference(short_dir, torch_dtype, YARN), TOKENS)
    unscaled = whole_forward(reference(short_dir, torch_dtype, None), TOKENS)
    primed = 180
    engine = Engine(loaded, EngineOptions(16, 1))
    cache = engine.new_cache()
    ours = prefill(loaded.model, cache, TOKENS[:primed], 0, 16)  # 12 grid chunks, the last past 64
    assert (ours - expected[primed - 1]).abs().max() < atol
    assert (unscaled[primed - 1] - expected[primed - 1]).abs().max() > 10 * atol, "scaling must matter here"
    decoder = Decoder(loaded.model, loaded.context_len, loaded.device)
    assert decoder.choice.value == "eager", decoder.choice.reason  # yarn is a static rope: the step covers it
    feed = decoder.feeder()
    for position in range(primed, len(TOKENS)):
        step = feed(cache, TOKENS[position], position)
        assert (step - expected[position]).abs().max() < atol, position


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="compiling the step needs a C++ compiler")
def test_the_compiled_step_decodes_scaled_positions_as_transformers_does(short_dir):
    torch.set_num_threads(1)
    loaded = load_model(str(short_dir), device="cpu", dtype="float32", context=SERVED, kv_dtype="activations")
    expected = whole_forward(reference(short_dir, torch.float32, YARN), TOKENS)
    compiled = Decoder(loaded.model, loaded.context_len, loaded.device, "on")
    compiled.start()
    assert compiled.choice.value == "compiled", compiled.choice.reason
    cache = Engine(loaded, EngineOptions(16, 1)).new_cache()
    prefill(loaded.model, cache, TOKENS[:180], 0, 16)
    feed = compiled.feeder()
    for position in range(180, 190):
        assert (feed(cache, TOKENS[position], position) - expected[position]).abs().max() < 1e-4, position
    # The native twin: the same package opened over the native rope's tables (memrad.engine.decode.native)
    native = whole_forward(reference(short_dir, torch.float32, None), TOKENS[:NATIVE])
    cache = Engine(loaded, EngineOptions(16, 1)).new_cache()
    with loaded.rope.under("native"):
        prefill(loaded.model, cache, TOKENS[:48], 0, 16)
    name, make = compiled.choose(None, native=True)
    feed = make()
    assert (name, feed.step) == ("compiled", "compiled")
    for position in range(48, 60):
        assert (feed(cache, TOKENS[position], position) - native[position]).abs().max() < 1e-4, position


def test_the_decode_steps_rope_table_carries_yarns_attention_factor(short_dir):
    loaded = load_model(str(short_dir), device="cpu", dtype="float32", context=SERVED)
    rotary = loaded.model.model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    table = Decoder(loaded.model, loaded.context_len, loaded.device).eager.cos  # [P, D]
    assert table.shape[0] == SERVED
    assert table[0].max().item() == pytest.approx(rotary.attention_scaling)  # cos(0) * factor


def test_a_session_primed_under_one_scaling_is_never_resumed_from_disk_under_another(short_dir):
    native = load_model(str(short_dir), device="cpu", dtype="float32", context=NATIVE)
    x2 = load_model(str(short_dir), device="cpu", dtype="float32", context=2 * NATIVE)
    x4 = load_model(str(short_dir), device="cpu", dtype="float32", context=SERVED)
    keys = [state_format(loaded, 16, "exact") for loaded in (native, x2, x4)]
    assert len({key["rope"] for key in keys}) == 3
    assert {k: v for k, v in keys[0].items() if k != "rope"} == {k: v for k, v in keys[2].items() if k != "rope"}
    shorter = load_model(str(short_dir), device="cpu", dtype="float32", context=32)
    assert state_format(shorter, 16, "exact") == keys[0]  # native lengths rotate alike: same bits


def test_a_resumed_turn_past_the_native_length_equals_its_cold_run(short_dir):
    torch.set_num_threads(1)
    loaded = load_model(str(short_dir), device="cpu", dtype="float32", context=SERVED)
    engine = make_engine(loaded, 16)
    system = {"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer. " * 2}
    first_turn = [system, {"role": "user", "content": "def add(a, b):\n    return a + b\n"}]
    first, _ = ask(engine, first_turn, "t1")
    assert first.prompt_tokens > NATIVE
    second_turn = first_turn + [{"role": "assistant", "content": first.text},
                                {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    warm, warm_state = ask(engine, second_turn, "t2")
    cold, cold_state = ask(engine, second_turn, "t2-cold", salt="cold")
    assert warm.decision.outcome == "resumed", warm.decision.render()
    assert warm.cached_tokens == first.prompt_tokens and cold.cached_tokens == 0
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits)
    assert warm.text == cold.text


async def test_models_and_health_say_what_is_served_and_how(short_dir):
    import aiohttp
    from aiohttp.test_utils import TestServer

    from memrad.config import Settings
    from memrad.server.app import make_app

    loaded = load_model(str(short_dir), device="cpu", dtype="float32", context=SERVED)
    server = TestServer(make_app(Settings(), Engine(loaded, EngineOptions(16, 1)), "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            models = await (await session.get(server.make_url("/v1/models"))).json()
            health = await (await session.get(server.make_url("/health"))).json()
    finally:
        await server.close()
    (model,) = models["data"]
    assert (model["context_length"], model["max_model_len"], model["context_window"]) == (SERVED,) * 3
    assert model["context_scaling"] == "yarn x4"
    assert health["context_len"] == SERVED
    assert (model["native_context_length"], model["context_rule"]) == (NATIVE, health["choices"]["context"]["reason"])
    assert health["choices"]["context"]["value"] == "native to 64, yarn x4 to 256"
    assert health["choices"]["context"]["reason"].startswith(
        "256 tokens served: a request whose prompt + max_tokens fits the native 64 runs at the model's native RoPE; "
        "one that needs more runs under yarn x4 from its first token")
