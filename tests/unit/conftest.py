import pytest
import torch

from memrad.engine.engine import Engine
from memrad.engine.loader import load_model
from tiny import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    torch.set_num_threads(1)
    return load_model(str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture
def tiny_engine(tiny_loaded):
    return Engine(tiny_loaded, prefill_chunk=16, threads=1)
