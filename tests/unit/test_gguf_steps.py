"""Qwen3 dense, Phi-3 and Gemma 2 from their GGUFs, on memra's decode steps.

Each tiny model of tests/unit/tiny_gguf.py, loaded through memra's GGUF path: Qwen3 (per-head
q/k RMSNorms) and Phi-3 (fused qkv and gate/up run as shipped) on the llama-shaped step, Gemma 2
(soft-capped attention and final logits, alternating sliding windows of 8) on its own, each
named in `memrad status`; in bf16 (what `auto` runs on this CPU) the step's logits are
transformers' forward's bit for bit (the forward attending one token with the step's layout, as
tests/unit/test_experts.py says why), with float weights and with the Q4_K blocks on the int4
kernel (fp32: within rounding of the fused matmul; Gemma 2's bit for bit too, and it would not
be without the attention soft-cap); the batched step (the llama-shaped one's twin and Gemma 2's
rows) gives a request's row the same bits at any neighbours and alone, Gemma 2's step after
step past its window, float weights and int4; an engine resumes turns bit-identically to
their cold runs (Gemma 2's rewritten reply at its windows' boundary snapshot); and compiled (compile = on, max_batch 2, on the int4 kernel's blocks) each one's
one-row and 2-row packages resume turns as cold, and a row on the 2-row graph is the compiled
one-row step's bits beside a neighbour, step after step.
"""

import pytest
import torch

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode import steps
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.package import PackagedStep
from memrad.engine.decode.steps.gemma2 import Gemma2Step
from memrad.engine.decode.steps.llama import DecodeStep
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.kernels import block_gemv
from memrad.engine.model.block_experts import BlockMoE
from memrad.engine.model.loader import load_model
from stories import ask, make_engine
from test_batching import rows_are_their_own
from test_experts import with_the_steps_attention_layout
from test_gemma_step import compiled_turns_equal_cold, rows_decode_their_own_bits
from test_reuse import conversation
from tiny_gguf import tiny_gguf

STEPPED = ("qwen3", "phi3", "gemma2", "qwen3_moe")
BATCHED = ("qwen3", "phi3", "qwen3_moe", "gemma2")  # the llama-shaped step's batched twin, and Gemma 2's rows
LAYERS = {"qwen3": "2 full-attention", "phi3": "2 full-attention", "gemma2": "2 sliding-window, 2 full-attention",
          "qwen3_moe": "2 full-attention; experts: top 2 of 8 per token"}
NAMES = {"qwen3_moe": "qwen3-moe"}  # what `memrad status` names the step, where not the architecture
PROMPT = list(range(5, 45))  # 40 tokens


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-steps")
    return {arch: tiny_gguf(folder, arch)[0] for arch in STEPPED}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))


def fresh(path, dtype="bfloat16", weights="auto"):
    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype=dtype, weights=weights, progress=lambda _: None)


@pytest.mark.parametrize("arch", STEPPED)
def test_the_step_covers_it_and_says_so(ggufs, arch):
    loaded = fresh(ggufs[arch], "bfloat16", "auto")
    assert steps.support(loaded.model, loaded.context_len) is None
    reason = f"{type(loaded.model).__name__} layers on one graph: {LAYERS[arch]}"
    name = NAMES.get(arch, arch)
    assert steps.describe(loaded.model, loaded.context_len) == steps.Choice(name, reason)
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["step"] == {"value": name, "reason": reason}
    assert isinstance(engine.decoder.eager_step, Gemma2Step if arch == "gemma2" else DecodeStep)


@pytest.mark.parametrize("arch", STEPPED)
@pytest.mark.parametrize("dtype,weights,tolerance", [("bfloat16", "float", 0.0), ("bfloat16", "auto", 0.0),
                                                     ("float32", "float", 1e-6)])
def test_the_step_decodes_transformers_bits(ggufs, arch, dtype, weights, tolerance):
    loaded = fresh(ggufs[arch], dtype, weights)
    assert loaded.weights.value == ("int4" if weights == "auto" else "float")
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    engine = Engine(loaded, EngineOptions(16, 1))
    ours, theirs = engine.new_cache(), engine.new_cache()
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    if arch == "gemma2":
        tolerance = 0.0  # no fused matmul changes a shape: every dtype gives the forward's bits
    else:  # the forward attends one token as the step does (test_experts: one row per head differs now and then)
        with_the_steps_attention_layout(loaded.model, feed.kernel)
    for step in range(12):  # Gemma 2: past its window of 8 (the 40-token prompt already is)
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert float((a - b).abs().max()) <= tolerance, (step, float((a - b).abs().max()))
    if tolerance == 0.0:
        assert torch.equal(ours.layers[1].keys, theirs.layers[1].keys)  # the step's KV rows: forward's bits


def test_the_gemma2_step_soft_caps_the_attention_scores(ggufs):
    """The cap is transformers' default 50 (no GGUF key carries it): dropping it changes the bits."""
    loaded = fresh(ggufs["gemma2"], "float32", "float")
    step = Decoder(loaded.model, loaded.context_len, loaded.device).eager_step
    assert [layer.softcap for layer in step.layers] == [50.0] * 4 and step.final_softcap == 30.0
    assert [layer.window for layer in step.layers] == [8, None, 8, None]
    engine = Engine(loaded, EngineOptions(16, 1))

    def logits():
        cache = engine.new_cache()
        prefill(loaded.model, cache, PROMPT, 0, 16)
        return Decoder(loaded.model, loaded.context_len, loaded.device).feeder()(cache, 7, len(PROMPT))

    cache = engine.new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    expected = decode_one_token(loaded.model, cache, 7, len(PROMPT))
    assert torch.equal(logits(), expected)
    loaded.model.config.attn_logit_softcapping = None  # a step built now drops the cap
    assert not torch.equal(logits(), expected)


@pytest.mark.parametrize("arch", BATCHED)
def test_every_row_of_the_batched_step_is_its_own_at_any_neighbours(ggufs, arch):
    loaded = fresh(ggufs[arch], "bfloat16", "auto")
    engine = make_engine(loaded, 16, max_batch=4)
    first = rows_are_their_own(engine, loaded.model, 16)
    cache = engine.new_cache()  # the one-row step gives the lone row the batched step's bits
    prefill(loaded.model, cache, list(range(5, 45)), 0, 16)
    assert torch.equal(engine.decoder.feeder()(cache, 11, 40).float(), first)


@pytest.mark.parametrize("weights", ["float", "auto"])
def test_a_gemma2_row_is_its_own_and_the_one_row_steps_past_the_window(ggufs, weights):
    loaded = fresh(ggufs["gemma2"], "bfloat16", weights)
    engine = make_engine(loaded, 16, max_batch=4)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    rows_decode_their_own_bits(engine, loaded.model, loaded.model.config.sliding_window)


@pytest.mark.parametrize("arch", STEPPED)
def test_an_engine_resumes_turns_bit_identical_to_cold(ggufs, arch):
    turns_resume_as_cold(make_engine(fresh(ggufs[arch], "bfloat16", "auto"), 16, max_sessions=16, mode="exact"))


def turns_resume_as_cold(engine):
    """Three turns of test_reuse.conversation: each after the first resumed, each the cold run's bits."""
    for turn, row in enumerate(conversation(engine, 3)):
        if turn:
            assert row["warm"].decision.outcome == "resumed", row["warm"].decision.render()
            assert row["warm"].cached_tokens > 0
        assert row["warm_state"].generated_ids == row["cold_state"].generated_ids
        assert len(row["warm_state"].generated_ids) > 1
        assert torch.equal(row["warm_state"].prompt_logits, row["cold_state"].prompt_logits)


def test_a_rewritten_gemma2_reply_resumes_from_the_windows_boundary_snapshot_below_it(ggufs):
    """Gemma 2's sliding windows cannot be cut back (their older rows are gone): a client that
    compacts turn 2's reply resumes at the snapshot taken at that reply's anchor, far past the
    window of 8, and its turn is the cold run's bit for bit."""
    engine = make_engine(fresh(ggufs["gemma2"], "bfloat16", "auto"), 16, max_sessions=16, mode="exact")
    assert compacted_reply_resumes_at_its_boundary(engine)[1] > 4 * 8


def compacted_reply_resumes_at_its_boundary(engine) -> list[int]:
    """Four turns, then a client compacts turn 2's reply: the fifth turn resumes at the snapshot
    taken at that reply's anchor (state that cannot be cut back: conv state, sliding windows) and
    is the cold run's bit for bit. Returns where each reply began."""
    system = "You are a helpful coding assistant. Read the file, then answer. " * 4
    messages = [{"role": "system", "content": system}]
    anchors = []
    for turn in range(1, 5):
        messages.append({"role": "user", "content": f"step {turn}: list files"})
        done, state = ask(engine, messages, f"t{turn}", max_tokens=4)
        anchors.append(done.prompt_tokens)  # where reply `turn` begins
        messages.append({"role": "assistant", "content": done.text})
    parked = state.session
    assert anchors[1] in parked.checkpoints, "the boundary before turn 2's reply is kept"
    messages[4] = {"role": "assistant", "content": "(compacted)"}
    messages.append({"role": "user", "content": "step 5: list files"})
    done, state = ask(engine, messages, "t5", max_tokens=4)
    reference, ref_state = ask(engine, messages, "t5-cold", salt="cold-t5", max_tokens=4)
    assert reference.cached_tokens == 0
    assert done.decision.outcome == "resumed" and done.decision.checkpoint == anchors[1], done.decision.render()
    assert torch.equal(state.prompt_logits, ref_state.prompt_logits) and done.text == reference.text
    return anchors


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("arch", STEPPED)
def test_the_compiled_packages_resume_bit_identical_and_give_a_batched_row_its_alone_bits(ggufs, arch):
    """compile = on, max_batch 2, from the GGUF on `auto` (the int4 kernel's blocks): the one-row
    package and the 2-row one are built (minutes on a shared 2-core machine) and open, turns
    resume on them bit-identical to their cold runs, and two rows on the compiled 2-row graph are
    each the compiled one-row step's bits, step after step (Gemma 2: past its window of 8).
    Qwen3-MoE's packages export its experts' blocks where memra's block kernel runs (each row's
    expert ids unbacked sizes from `.item()`, as gpt-oss's); the blocks' other checks are
    tests/unit/test_qwen3_moe_blocks.py's, on this same file."""
    loaded = fresh(ggufs[arch], "bfloat16", "auto")
    if arch == "qwen3_moe" and block_gemv.why_not() is None:  # the packages export the chosen experts' blocks
        assert isinstance(loaded.model.model.layers[0].mlp, BlockMoE)
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
    compiled_turns_equal_cold(engine)
    compiled_rows_are_the_one_row_steps(engine, (PROMPT, PROMPT[:5]), 16)


def compiled_rows_are_the_one_row_steps(engine, prompts, steps: int) -> None:
    """`engine`'s compiled packages (one row and 2 rows, already built): the decoder chose them
    and checked that a lone request's one-row step gives a batched row's bits; `prompts` (two)
    greedy-decoded side by side on the 2-row graph for `steps` steps, each row at every step the
    compiled one-row step's bits from the same state, so a row is the same bits batched and alone."""
    decoder, model = engine.decoder, engine.loaded.model
    assert isinstance(decoder.step, PackagedStep)
    assert decoder.batch_choice.value == "compiled", decoder.batch_choice.reason
    feed = decoder.batch_step(2)
    assert list(decoder.batch_packages) == [2] and feed.compiled and feed.alone is not None
    together, alone = ([engine.new_cache() for _ in prompts] for _ in range(2))
    for cache, twin, prompt in zip(together, alone, prompts):
        prefill(model, cache, prompt, 0, 16)
        prefill(model, twin, prompt, 0, 16)
    tokens = [7] * len(prompts)
    for step in range(steps):
        rows = feed(together, tokens, [len(p) + step for p in prompts])  # [2, V] float32
        for r, prompt in enumerate(prompts):
            lone = decoder.feeder()(alone[r], tokens[r], len(prompt) + step).float()
            assert torch.equal(rows[r], lone), (step, r, float((rows[r] - lone).abs().max()))
        tokens = [int(row.argmax()) for row in rows]
