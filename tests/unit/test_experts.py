"""Qwen3-MoE's routed experts on the llama-shaped step (memrad.engine.decode.steps.experts).

The tiny Qwen3-MoE of tests/unit/tiny_gguf.py (8 experts of 768, 2 a token, Q4_K / Q6_K experts,
an F32 router), loaded through memra's GGUF path: the step's router picks, token after token and
layer after layer, the forward's experts with the forward's weights; an expert a token did not
choose is never read (poisoned with NaN, the logits do not change; a chosen one poisoned, they
do); the batched step routes each row on its own, so in fp32, where one grouped matmul over
several rows would change a row's bits, a row is the same bits alone and beside any others; and
the feed-forward bytes a token reads are the router's plus 2 of 8 experts'.

The forward the step is held to attends one token's queries as the step does (memra's decode
kernel, the query heads of a KV head as the rows of one query block): transformers' maskless
one-token call (`enable_gqa`, one row per head) differs from it in the last bit now and then
(torch's SDPA in the step's layout did too: one of 14 steps, 0.0039 in a bf16 logit), for every
llama-shaped step alike; with the attention held equal, every step is the forward's bit for
bit, MoE block, router, norms and all.
"""

import pytest
import torch
from torch.nn import functional as F

from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.steps import experts
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.loader import load_model
from stories import make_engine
from test_batching import rows_are_their_own
from tiny_gguf import tiny_gguf

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("experts"), "qwen3_moe")[0]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))


def fresh(path, dtype="bfloat16", weights="auto"):
    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype=dtype, weights=weights, progress=lambda _: None)


def with_the_steps_attention_layout(model, kernel):
    """Make `model`'s forward attend one token as the step does, on memra's kernel or not (prefill:
    unchanged)."""
    from transformers import AttentionInterface

    prefill_attention = AttentionInterface()[model.config._attn_implementation]

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] > 1:
            return prefill_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        _, heads, _, dim = query.shape
        kv_heads = key.shape[1]
        q = query.view(1, kv_heads, heads // kv_heads, dim)
        # the step's attention: memra's kernel over bf16 rows (its bits over the rows widened, as the cache
        # hands them here), else torch's (compile = off)
        out = (torch.ops.memra.decode_attention(q, key, value, scaling) if kernel
               else F.scaled_dot_product_attention(q, key, value, scale=scaling))  # [1, H_kv, G, D]
        return out.reshape(1, heads, 1, dim).transpose(1, 2), None  # [1, 1, H, D]

    AttentionInterface.register("memra_test_step_layout", attend)
    model.config._attn_implementation = "memra_test_step_layout"


def routes(model, router=lambda layer: layer.mlp.gate):
    """Record every router call of `model` (each layer's `router`: Qwen3-MoE's `mlp.gate`): a list
    that fills with (layer, ids [k], weights [k])."""
    seen = []
    for index, layer in enumerate(model.model.layers):
        def hook(_module, _args, out, index=index):
            _, weights, ids = out
            seen.append((index, ids.clone(), weights.clone()))
        router(layer).register_forward_hook(hook)
    return seen


def primed(loaded, engine):
    cache = engine.new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    return cache


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_router_chooses_what_the_forward_chooses(gguf, dtype):
    loaded = fresh(gguf, dtype)
    engine = Engine(loaded, EngineOptions(16, 1))
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = primed(loaded, engine), primed(loaded, engine)
    with_the_steps_attention_layout(loaded.model, feed.kernel)
    seen = routes(loaded.model)
    token = 7
    for step in range(12):
        a = feed(ours, token, len(PROMPT) + step)
        step_routes = seen[:]
        seen.clear()
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert len(step_routes) == len(seen) == 2  # one router call a layer, one token
        for (layer, ids, weights), (layer_f, ids_f, weights_f) in zip(step_routes, seen):
            assert layer == layer_f and ids.shape == (1, 2)
            assert torch.equal(ids, ids_f) and torch.equal(weights, weights_f)
            assert float(weights.float().sum()) == pytest.approx(1.0, abs=1e-2)  # renormalised top 2
        seen.clear()
        assert (torch.equal(a, b) if dtype == "bfloat16" else float((a - b).abs().max()) <= 1e-6), step
        token = int(b.argmax())


def primed_and_chosen(loaded):
    """(the step's feed, two caches primed with PROMPT (the prompt read every expert), the logits
    of token 7 after it from a third, {layer: the experts that token chose}): for poisoning."""
    engine = Engine(loaded, EngineOptions(16, 1))
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    clean, poisoned, poisoned_chosen = (primed(loaded, engine) for _ in range(3))
    seen = routes(loaded.model)
    expected = feed(clean, 7, len(PROMPT))
    chosen = {layer: set(ids.view(-1).tolist()) for layer, ids, _ in seen}
    assert len(seen) == len(loaded.model.model.layers) and all(len(ids) == 2 for ids in chosen.values())
    return feed, poisoned, poisoned_chosen, expected, chosen


def test_an_expert_the_token_did_not_choose_is_never_read(gguf):
    loaded = fresh(gguf, "float32", "float")
    feed, poisoned, poisoned_chosen, expected, chosen = primed_and_chosen(loaded)
    layers = loaded.model.model.layers
    with torch.no_grad():
        for index, layer in enumerate(layers):
            for e in set(range(8)) - chosen[index]:
                layer.mlp.experts.gate_up_proj[e] = float("nan")
                layer.mlp.experts.down_proj[e] = float("nan")
    assert torch.equal(feed(poisoned, 7, len(PROMPT)), expected)
    with torch.no_grad():
        layers[1].mlp.experts.down_proj[min(chosen[1])] = float("nan")  # a chosen one: the test can fail
    assert torch.isnan(feed(poisoned_chosen, 7, len(PROMPT))).all()


@pytest.mark.parametrize("dtype,weights", [("float32", "float"), ("bfloat16", "auto")])
def test_every_batched_row_is_routed_on_its_own(gguf, dtype, weights):
    loaded = fresh(gguf, dtype, weights)
    engine = make_engine(loaded, 16, max_batch=4)
    first = rows_are_their_own(engine, loaded.model, 16)
    if dtype == "bfloat16":  # the one-row step gives the lone row the batched row's bits
        assert torch.equal(engine.decoder.feeder()(primed(loaded, engine), 11, 40).float(), first)


def test_a_token_reads_the_router_and_two_of_eight_experts(gguf):
    model = fresh(gguf, "bfloat16", "auto").model
    router, expert = 8 * 256 * 2, (1536 * 256 + 256 * 768) * 2  # bf16: the experts stay float (3-D, not Linear)
    assert experts.bytes_per_token(model) == (2 * (router + 2 * expert), 2 * (router + 8 * expert))
    assert all(experts.is_sparse(layer.mlp) for layer in model.model.layers)
