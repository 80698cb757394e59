import json

import pytest
import torch

from memrad.engine.model.loader import load_model
from memrad.engine.model.random_model import copy_shape, write_random_model


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
    assert drawn.weights.value == "int4" and drawn.head == "q8_0"  # the kernels the default model runs
    again = load_model(str(write_random_model(shape, tmp_path / "again", seed=3)), device="cpu", dtype="float32")
    assert torch.equal(dict(again.model.named_parameters())["model.embed_tokens.weight"],
                       ours["model.embed_tokens.weight"])  # the seed decides the weights


def test_a_folder_without_a_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        copy_shape(tmp_path, tmp_path / "out")
