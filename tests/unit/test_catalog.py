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
