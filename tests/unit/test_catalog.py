"""The named models are one table: a row is all the loader and `memrad pull` need."""

from dataclasses import replace

import pytest

from memrad.engine.model import catalog
from memrad.engine.model.loader import resolve_model_folder
from memrad.engine.model.pull import MARKER, ModelUnavailable, has_block_caches, model_dir


def test_every_row_is_named_by_its_key_and_has_its_own_folder():
    assert list(catalog.CATALOG) == ["default", "gemma3-270m"]
    assert all(name == entry.name for name, entry in catalog.CATALOG.items())
    assert len({entry.model_id for entry in catalog.CATALOG.values()}) == len(catalog.CATALOG)
    assert catalog.lookup("default") is catalog.DEFAULT and catalog.lookup("nope") is None
    assert catalog.names() == "`default`, `gemma3-270m`"


def test_a_third_row_is_served_by_name_with_no_other_edit(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    row = replace(catalog.GEMMA3_270M, name="tiny-named", model_id="TinyNamed-1M")
    monkeypatch.setitem(catalog.CATALOG, row.name, row)
    with pytest.raises(ModelUnavailable, match="run `memrad pull tiny-named`"):
        resolve_model_folder("tiny-named", print, allow_pull=False)
    folder = model_dir(row)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    assert resolve_model_folder("tiny-named", print, allow_pull=False) == ("TinyNamed-1M", folder)
    assert not has_block_caches(folder)


def test_memrad_pull_names_the_catalog_when_it_gets_something_else(capsys):
    from memrad.cli import main

    assert main(["pull", "not-a-model"]) == 2
    assert "pull takes `default`, `gemma3-270m` or a .gguf file" in capsys.readouterr().err


def test_the_default_model_is_served_at_32k_past_its_native_8k():
    assert (catalog.DEFAULT.native_context, catalog.DEFAULT.served_context) == (8192, 32768)
    assert (catalog.GEMMA3_270M.native_context, catalog.GEMMA3_270M.served_context) == (32768, 32768)


def test_memrad_models_lists_what_is_pulled_its_size_and_what_can_be_pulled(tmp_path, monkeypatch, capsys):
    import json

    from memrad.cli import main

    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    folder = model_dir(catalog.DEFAULT)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * (3 * 2**20 - 2))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["default", "yes,", "3", "MiB", "32,768", "(native"]
    assert lines[2].split()[:6] == ["gemma3-270m", "no", "(~250", "MB)", "32,768", "(native)"]
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert (rows["default"]["pulled"], rows["default"]["bytes_on_disk"]) == (True, 3 * 2**20)
    assert (rows["gemma3-270m"]["pulled"], rows["gemma3-270m"]["bytes_on_disk"]) == (False, 0)
