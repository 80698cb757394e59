import json

import pytest
import torch

from memrad.engine.decode import steps
from memrad.engine.kernels import block_gemv
from memrad.engine.model.loader import load_model
from memrad.engine.model.random_model import NAMED_SHAPES, copy_shape, write_named_shape, write_random_model


def test_the_shape_is_config_and_tokenizer_only(tiny_llama_dir, tmp_path):
    copied = copy_shape(tiny_llama_dir, tmp_path / "shape")
    assert "config.json" in copied and "tokenizer.json" in copied
    assert sorted(p.name for p in (tmp_path / "shape").iterdir()) == sorted(copied)
    assert not list((tmp_path / "shape").glob("*.safetensors"))


def test_a_random_model_has_the_shape_and_tokenizer_of_its_source_and_other_weights(tiny_llama_dir, tmp_path):
    shape = tmp_path / "shape"
    copy_shape(tiny_llama_dir, shape)
    out = write_random_model(shape, tmp_path / "random", seed=3)
    source = load_model(str(tiny_llama_dir), device="cpu", dtype="float32")
    drawn = load_model(str(out), device="cpu", dtype="float32")
    assert json.loads((out / "config.json").read_text())["hidden_size"] == source.model.config.hidden_size
    assert drawn.tokenizer("a b c")["input_ids"] == source.tokenizer("a b c")["input_ids"]
    assert drawn.context_len == source.context_len and drawn.eos_ids == source.eos_ids
    ours = dict(drawn.model.named_parameters())
    theirs = dict(source.model.named_parameters())
    assert {n: p.shape for n, p in ours.items()} == {n: p.shape for n, p in theirs.items()}
    assert not torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    # the kernels the default model runs: its Q8_0 head's blocks on memra's kernel where that runs
    assert drawn.weights.value == "int4" and drawn.head == ("q8_0 blocks" if block_gemv.why_not() is None else "q8_0")
    again = load_model(str(write_random_model(shape, tmp_path / "again", seed=3)), device="cpu", dtype="float32")
    assert torch.equal(dict(again.model.named_parameters())["model.embed_tokens.weight"],
                       ours["model.embed_tokens.weight"])  # the seed decides the weights


def test_a_folder_without_a_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        copy_shape(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_every_named_hybrid_shape_decodes_on_a_step(name, tiny_llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(NAMED_SHAPES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=400, **fields)
    with torch.device("meta"):  # shapes only: no weights drawn
        model = AutoModelForCausalLM.from_config(config)
    assert steps.support(model, 4096) is None
    assert steps.describe(model, 4096).value == name


def test_a_named_shape_is_written_over_a_tokenizer_in_bfloat16(tiny_llama_dir, tmp_path, monkeypatch):
    small = dict(NAMED_SHAPES["qwen3-next"], hidden_size=64, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
                 linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, intermediate_size=128, max_position_embeddings=1024)
    monkeypatch.setitem(NAMED_SHAPES, "qwen3-next", small)
    out = write_named_shape("qwen3-next", tiny_llama_dir, tmp_path / "q3n", seed=1)
    drawn = load_model(str(out), device="cpu", dtype="bfloat16")
    source = load_model(str(tiny_llama_dir), device="cpu", dtype="float32")
    assert type(drawn.model).__name__ == "Qwen3NextForCausalLM"
    assert drawn.model.config.vocab_size == len(source.tokenizer) and drawn.eos_ids == source.eos_ids
    assert drawn.model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert next(drawn.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no shape named 'mamba'"):
        write_named_shape("mamba", tiny_llama_dir, tmp_path / "m")
