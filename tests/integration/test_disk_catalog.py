"""Every catalog model's cache, through the disk tier in process: one request, the stop
spills it, a new engine on the same directory loads every layer and snapshot bit-exact,
and the next turn resumed from disk answers what a cold run answers (issue 23 item 1).
gemma3-270m is the one whose sliding-window layers hold a 0-dim int64 tensor and keep only
the last 512 rows: the prompt is longer than that window."""

import pytest
import torch

import stories
from memrad.engine.model.catalog import CATALOG
from memrad.engine.model.pull import is_converted, model_dir
from memrad.engine.state.disk import DiskTier, state_format

pytestmark = pytest.mark.integration

CHUNK = 256
PROMPT = "Summarise what each of these files does, one line each. " + " ".join(
    f"src/module_{i}.py defines class Handler{i} with methods load, save and check." for i in range(40))


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_a_catalog_models_cache_spills_and_reloads_bit_exact(name, tmp_path):
    from memrad.engine.model.loader import load_model

    if not is_converted(model_dir(CATALOG[name])):
        pytest.skip(f"{name} is not in the cache: run `memrad pull {name}`")
    torch.set_num_threads(2)
    loaded = load_model(name, device="cpu", dtype="float32", allow_pull=False)

    def engine():
        disk = DiskTier(tmp_path, 2**32, state_format(loaded, CHUNK, "exact"), loaded.rope_keys)
        return stories.make_engine(loaded, CHUNK, 2, max_sessions=4, max_bytes=2**32, disk=disk, mode="exact")

    before = engine()
    first = [{"role": "user", "content": PROMPT}]
    one, finished = stories.ask(before, first, "t1", max_tokens=4)
    assert one.prompt_tokens > 512
    parked = finished.session
    assert before.parking.spill_all() == []
    after = engine()
    state = after.parking.disk.load(after.parking.disk.pool.get(parked.session_id), after.new_cache)
    stories.assert_same_state(state, parked.state)
    second = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "Now the tests."}]
    after = engine()
    (warm, warm_state), (cold, cold_state) = (stories.ask(after, second, "t2", max_tokens=4),
                                              stories.ask(after, second, "t2", salt="cold", max_tokens=4))
    assert warm.decision.outcome == "resumed" and warm.cached_tokens > 0 and cold.cached_tokens == 0
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits) and warm.text == cold.text
