import pytest
import torch

from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.model.loader import load_model
from fake_engine import FakeEngine
from tiny import save_tiny, write_q4_folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Folders of tiny random models, made once per kind per test session."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = save_tiny(tmp_path_factory.mktemp(f"tiny-{kind}"), kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    torch.set_num_threads(1)
    return load_model(str(tiny_llama_dir), device="cpu", dtype="float32")


class _ByKind(dict):
    def __init__(self, tiny_dir) -> None:
        super().__init__()
        self.tiny_dir = tiny_dir

    def __missing__(self, kind: str):
        torch.set_num_threads(1)
        self[kind] = load_model(str(self.tiny_dir(kind)), device="cpu", dtype="float32")
        return self[kind]


@pytest.fixture(scope="session")
def loaded(tiny_dir):
    """Tiny models by kind (loaded["llama"], loaded["qwen3_next"], ...), each loaded once."""
    return _ByKind(tiny_dir)


@pytest.fixture
def fake_engine():
    """A torch-free engine for server tests where the model is not the point."""
    return FakeEngine()


@pytest.fixture
def tiny_engine(tiny_loaded):
    return Engine(tiny_loaded, EngineOptions(16, 1))


@pytest.fixture(scope="session")
def q4_dir(tmp_path_factory):
    """The tiny llama shaped like SmolLM2's GGUF: Q4_1 layers, a tied Q8_0 head (tiny.write_q4_folder)."""
    return write_q4_folder(tmp_path_factory.mktemp("tiny-q4"))


@pytest.fixture(scope="session")
def q4_bf16(q4_dir):
    """That llama loaded in bf16 on the int4 kernel: a matmul's row is the same bits at any M
    (memrad.engine.decode.batch), so the eager one-row step verifies drafts (memrad.engine.speculation)."""
    return load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
