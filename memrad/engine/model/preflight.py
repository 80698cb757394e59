"""Said before the wait: what `memrad start --model X.gguf` will serve, read from the header.

Converting a GGUF takes transformers ~20 s and loading it more; a user who pointed memrad at
a model it serves on the slow path, or cannot serve at all, learns that before waiting, not
after. Everything here comes from the GGUF's header (memrad.engine.model.gguf_header, well
under a second) and a model built on the meta device (no weights, no memory):

    architecture   the GGUF's and the transformers class it becomes
    decode step    which compiled step decodes it (memrad.engine.decode.steps), or why none does
    quants         the GGUF type of each tensor kind (attn_q, ffn_down, ...), as shipped
    context        native and served (memrad.engine.model.context: the same plan the load makes)
    KV             bytes per token of context in the rows' dtype (memrad.engine.model.kv_dtype)
    experts        a mixture's 3-D expert tensors: gpt-oss's and Qwen3-MoE's run from their blocks
                   on memra's kernel where it runs and runs their kinds (memrad.engine.model.block_experts),
                   others dequantised at load; the bytes a token reads of them as shipped (MXFP4: 17
                   bytes a 32 weights, Q4_K 144 a 256) and dense in that dtype

Refused here, with the reason: architectures transformers' GGUF loader does not read, and the
Mamba-1 family (Mamba, FalconMamba, Jamba), whose multi-token forward ignores cached recurrent
state in transformers 5.x, so chunked prefill and resumed turns would be silently wrong. A Gemma 4
GGUF's layout keys (layer pattern, KV-shared layers, per-layer input width, sliding head dim, rope
bases, final soft-cap, a mixture's expert counts and width), which transformers' loader reads none of, are read by memra
(memrad.engine.model.gguf_gemma4); such a file is refused only where one comes out other than
the file says (`gemma4_layout_lost`) or it ships a tensor memra's reader does not place.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memrad.engine.model import context as served_context
from memrad.engine.model import block_experts, gguf_fill, gguf_gemma4, gguf_gpt_oss, kv_dtype
from memrad.engine.model.context import ServedContext
from memrad.engine.model.gguf_header import GGUFHeader, LongArray, read_header
from memrad.engine.model.hardware import Choice
from memrad.engine.model.unavailable import ModelUnavailable

# GGUF architecture names of the Mamba-1 family (llama.cpp writes FalconMamba as "mamba").
REFUSED_ARCHITECTURES = ("mamba", "jamba", "falcon_mamba", "falcon-mamba")
# llama.cpp's names that transformers' GGUF loader renames (transformers.modeling_gguf_pytorch_utils).
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_TEXT_ONLY = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}  # GGUFs hold the text backbone only
_ATTENTION_KINDS = ("full_attention", "sliding_attention")
ON_BLOCKS = " blocks on memra's block kernel"  # in `experts_run` where the experts run from their blocks
_BLOCK_EXPERTS = (gguf_gpt_oss.ARCHITECTURE, "qwen3moe")  # whose experts memra keeps as blocks
# Gemma 4's layout keys that transformers' GGUF loader (5.24) does not read and memra's reader does
# (memrad.engine.model.gguf_gemma4): (llama.cpp's key, what the built config has, in the key's terms).
_GEMMA4_LAYOUT = (
    ("attention.sliding_window_pattern", lambda c: [kind == "sliding_attention" for kind in c.layer_types]),
    ("attention.shared_kv_layers", lambda c: c.num_kv_shared_layers),
    ("embedding_length_per_layer_input", lambda c: c.hidden_size_per_layer_input),
    ("attention.key_length_swa", lambda c: c.per_layer_config[c.layer_types.index("sliding_attention")].head_dim
     if "sliding_attention" in c.layer_types else None),
    ("rope.freq_base", lambda c: c.rope_parameters["full_attention"]["rope_theta"]),
    ("rope.freq_base_swa", lambda c: c.rope_parameters["sliding_attention"]["rope_theta"]),
    ("final_logit_softcapping", lambda c: c.final_logit_softcapping),
    ("expert_count", lambda c: c.num_experts if c.enable_moe_block else None),
    ("expert_used_count", lambda c: c.top_k_experts if c.enable_moe_block else None),
    ("expert_feed_forward_length", lambda c: c.moe_intermediate_size if c.enable_moe_block else None),
)


@dataclass(frozen=True, slots=True)
class Preflight:
    """What a GGUF will be served as, before its weights are read."""

    path: Path
    architecture: str  # the GGUF's general.architecture
    model_class: str  # the transformers class it loads as
    step: Choice  # memrad.engine.decode.steps.describe: "llama", "gemma3", ..., or "none" and why
    quants: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]  # (tensor kind, ((GGUF type, tensors), ...))
    context: ServedContext
    kv_bytes_per_token: int  # every attention layer's K and V row for one token, in `kv_dtype`
    dtype: str
    kv_dtype: str  # the rows' (memrad.engine.model.kv_dtype): bf16 under fp32 activations where the step reads it
    window_layers: int  # sliding-window layers among the attention ones (their rows stop at the window)
    window_tokens: int | None
    # A mixture of experts: (bytes a token reads of its 3-D experts dequantised in `dtype`, as
    # shipped), their top k of E in every layer; None without experts.
    expert_bytes: tuple[int, int] | None = None
    # Where the experts run: "MXFP4 blocks on memra's block kernel (PATH)...", or why they are dequantised.
    experts_run: str = "dequantised at load (3-D tensors: no packed form)"

    def lines(self) -> list[str]:
        """The lines `memrad start` and `memrad pull` print."""
        step = (f"yes, memra's {self.step.value} step ({self.step.reason})" if self.step.value != "none"
                else f"no: transformers' forward ({self.step.reason})")
        quants = "; ".join(f"{kind} " + ", ".join(f"{name}" + (f" x{count}" if len(types) > 1 else "")
                                                   for name, count in types)
                           for kind, types in self.quants)
        window = (f"; {self.window_layers} sliding-window layers keep at most {self.window_tokens:,} rows"
                  if self.window_layers else "")
        dense, shipped = self.expert_bytes or (0, 0)
        read = (f"a token reads {shipped:,} B of them as shipped ({dense:,} B dequantised in {self.dtype})"
                if ON_BLOCKS in self.experts_run else
                f"a token reads {dense:,} B of them in {self.dtype} ({shipped:,} B as shipped)")
        experts = [f"  experts: {self.experts_run}, {read}"] if self.expert_bytes else []
        return [
            f"{self.path.name}: {self.architecture} ({self.model_class})",
            f"  fast decode step: {step}",
            f"  quants: {quants}",
            f"  context: native {self.context.native_tokens:,}, served {self.context.num_tokens:,} "
            f"({self.context.describe()})",
            f"  KV: {self.kv_bytes_per_token:,} B/token in {self.kv_dtype}{window}",
            *experts,
        ]


def inspect_gguf(path: Path, requested_context: int, dtype: torch.dtype, weights: str = "auto",
                 device: str = "cpu") -> Preflight:
    """The Preflight of the GGUF at `path` served with `requested_context` tokens (0: native),
    activations in `dtype`, `weights` (model.weights) on `device` (its type); raises
    ModelUnavailable for what memrad cannot serve."""
    from transformers import AutoModelForCausalLM

    from memrad.engine.decode import steps
    from memrad.engine.kernels.build import cxx_compiler

    header = read_header(path)
    config = gguf_config(header, path)
    served = served_context.plan(config, requested_context)
    served_context.apply(config, served)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ModelUnavailable(f"{path} ({header.architecture}) is not a causal language model "
                               f"transformers can build: {exc}") from exc
    step = steps.describe(model, served.num_tokens)
    rows = kv_dtype.decide("auto", dtype, device, steps.attends_on_kernel(model, served.num_tokens),
                           lambda: None if cxx_compiler() else "no C++ compiler to build it")
    rows_dtype = torch.bfloat16 if rows.value == "bfloat16" else dtype
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    window_layers = kinds.count("sliding_attention")
    return Preflight(
        path=path, architecture=header.architecture, model_class=type(model).__name__, step=step,
        quants=quants_by_kind(header), context=served,
        kv_bytes_per_token=sum(2 * heads * dim for heads, dim in steps.kv_row_shapes(config)) * rows_dtype.itemsize,
        dtype=str(dtype).removeprefix("torch."), kv_dtype=rows.value, window_layers=window_layers,
        window_tokens=getattr(config, "sliding_window", None) if window_layers else None,
        expert_bytes=expert_bytes(header, config, dtype), experts_run=experts_run(header, weights, device))


def experts_run(header: GGUFHeader, weights: str, device: str) -> str:
    """Where a mixture's experts will run: gpt-oss's and Qwen3-MoE's from their blocks on memra's
    kernel (memrad.engine.model.block_experts) where every expert tensor ships in a kind the kernel
    runs, the weights run as shipped and the kernel runs here, else dequantised, and why."""
    from memrad.engine.kernels import block_gemv

    experts = block_experts.EXPERT_TENSORS
    kinds = sorted({tensor.kind for tensor in header.tensors if experts.fullmatch(tensor.name)})
    if header.architecture not in _BLOCK_EXPERTS:
        return "dequantised at load (3-D tensors: no packed form)"
    other = [kind for kind in kinds if kind not in block_experts.RUNS]
    if other:
        return f"dequantised at load ({', '.join(other)}: a kind memra's block kernel does not run)"
    if weights in ("float", "int8"):
        return f"dequantised at load (--weights {weights})"
    if device != "cpu":
        return f"dequantised at load (memra's block kernel is CPU-only, {device})"
    why_not = block_gemv.why_not()
    if why_not is not None:
        return f"dequantised at load (memra's block kernel: {why_not})"
    return f"{' / '.join(kinds)}{ON_BLOCKS} ({block_gemv.path()}), the chosen experts only"


def expert_bytes(header: GGUFHeader, config: Any, dtype: torch.dtype) -> tuple[int, int] | None:
    """(bytes a token reads of the 3-D expert tensors dequantised in `dtype`, as shipped): top k of
    E experts in every layer; None for a model without them."""
    from memrad.engine.decode.steps import experts as routed
    from memrad.engine.model.formats import shipped_bytes

    experts = [tensor for tensor in header.tensors if block_experts.EXPERT_TENSORS.fullmatch(tensor.name)]
    total = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts or not total:
        return None
    top_k = routed.top_k(config)
    dense = sum(math.prod(t.shape) * dtype.itemsize for t in experts) * top_k // total
    return dense, sum(shipped_bytes(t.kind, math.prod(t.shape)) for t in experts) * top_k // total


def quants_by_kind(header: GGUFHeader) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """Each tensor kind (the name without its block number, e.g. "attn_q") with the GGUF types
    its tensors ship in, the most common first."""
    kinds: dict[str, Counter] = {}
    for tensor in header.tensors:
        kind = re.sub(r"^blk\.\d+\.", "", tensor.name).removesuffix(".weight")
        kinds.setdefault(kind, Counter())[tensor.kind] += 1
    return tuple((kind, tuple(types.most_common())) for kind, types in kinds.items())


def gguf_config(header: GGUFHeader, path: Path) -> Any:
    """The transformers config its GGUF loader builds from `header` (the same field mapping),
    or ModelUnavailable for an architecture memrad cannot serve."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = header.architecture
    if arch in REFUSED_ARCHITECTURES:
        raise ModelUnavailable(
            f"{path} is a {arch} model (the Mamba-1 family): in transformers 5.x its multi-token forward "
            "ignores cached recurrent state, so chunked prefill and resumed turns would be wrong. Use an "
            "attention, Mamba-2 or hybrid linear-attention model (e.g. Qwen3, Qwen3-Next, LFM2, FalconH1).")
    name = _RENAMED.get(arch, arch)
    if "llama" in arch and "mistral" in str(header.fields.get("general.name", "")).lower():
        name = "mistral"
    if name not in GGUF_CONFIG_MAPPING or name in ("general", "tokenizer"):
        readable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
        raise ModelUnavailable(f"{path} is a {arch!r} GGUF, which transformers' GGUF loader does not read "
                               f"(it reads {', '.join(readable)})")
    mappings = {arch: GGUF_CONFIG_MAPPING[name], "general": GGUF_CONFIG_MAPPING["general"],
                "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"]}
    values: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(name, {}))
    values["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in header.tensors)
    for key, value in header.fields.items():
        prefix, _, rest = key.partition(".")
        attribute = mappings.get(prefix, {}).get(rest)
        if attribute not in (None, -1) and not isinstance(value, LongArray):
            values[attribute] = value
    values["model_type"] = name
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and isinstance(tokens, (LongArray, list)):  # a list: a short (tiny) vocabulary
        values["vocab_size"] = tokens.num_items if isinstance(tokens, LongArray) else len(tokens)
    if name == "lfm2":  # as transformers' loader: one KV head count per layer, 0 on the conv layers
        per_layer = values["num_key_value_heads"]
        values.update(num_key_value_heads=max(per_layer), block_auto_adjust_ff_dim=False,
                      full_attn_idxs=[i for i, heads in enumerate(per_layer) if heads > 0])
        if "rms_norm_eps" in values:  # LFM2's config names it norm_eps
            values["norm_eps"] = values.pop("rms_norm_eps")
    if name == "gpt_oss":
        values.update(gpt_oss_fields(header))
    if name == "gemma4":  # the layout transformers' mapping misses (memrad.engine.model.gguf_gemma4)
        values.update(gguf_gemma4.config_fields(header, path))
    model_type = _TEXT_ONLY.get(values.get("model_type", name), values.get("model_type", name))
    values["model_type"] = model_type
    try:
        config = CONFIG_MAPPING[model_type].from_dict(values)
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelUnavailable(f"{path}: transformers cannot make a {model_type} config of its header: {exc}") from exc
    if model_type == "gemma4_text":
        refuse_unread_gemma4(header, config, path)
    return config


def refuse_unread_gemma4(header: GGUFHeader, config: Any, path: Path) -> None:
    """ModelUnavailable for a gemma4 GGUF memra's reader would not load as the file's model: a
    layout key its config came out without (`gemma4_layout_lost`), or a tensor its table does not
    place (memrad.engine.model.gguf_gemma4.TABLE; e.g. a shared expert's ffn_gate_inp_shexp), each
    by name."""
    lost = gemma4_layout_lost(header, config)
    if lost:
        raise ModelUnavailable(f"{path} is a gemma4 GGUF whose layout memra's reader does not read, so it would "
                               f"build another model: {'; '.join(lost)}")
    unplaced = gguf_fill.unplaced(gguf_gemma4.TABLE, (tensor.name for tensor in header.tensors))
    if unplaced:
        raise ModelUnavailable(f"{path} is a gemma4 GGUF with tensors memra's reader does not place: "
                               f"{gguf_fill.named(unplaced)}")


def gemma4_layout_lost(header: GGUFHeader, config: Any) -> list[str]:
    """Each Gemma 4 layout key of `header` whose value differs from what `config` has
    (`_GEMMA4_LAYOUT`; and the per-layer embedding's rows), as "key: the GGUF's X, the config's Y";
    empty where the config is the file's layout (as memra's reader builds it)."""
    arch, lost = header.architecture, []
    for key, built in _GEMMA4_LAYOUT:
        value = header.fields.get(f"{arch}.{key}")
        if value is None:
            continue
        value = [bool(v) for v in value] if isinstance(value, (list, tuple)) else value
        theirs = built(config)
        if value != theirs and not (isinstance(value, float) and theirs is not None and abs(value - theirs) < 1e-3):
            lost.append(f"{key}: the GGUF's {value}, the config's {theirs}")
    rows = next((t.shape[-1] for t in header.tensors if t.name == "per_layer_token_embd.weight"), None)
    if rows is not None and rows != config.vocab_size_per_layer_input:
        lost.append(f"per_layer_token_embd rows: the GGUF's {rows}, the config's {config.vocab_size_per_layer_input}")
    return lost


def gpt_oss_fields(header: GGUFHeader) -> dict[str, Any]:
    """What a gpt-oss GGUF carries that transformers' field mapping misses (its loader fails on
    the rope keys): the head width (`attention.key_length`), the sliding window
    (`attention.sliding_window`), the experts' width and YaRN's factor and native length. YaRN's
    betas and `truncate` are not in the file: gpt-oss's config.json values (32, 1, false)."""
    values = {"head_dim": header.arch_field("attention.key_length"),
              "sliding_window": header.arch_field("attention.sliding_window"),
              "intermediate_size": header.arch_field("expert_feed_forward_length")}
    values = {key: value for key, value in values.items() if value is not None}
    if header.arch_field("rope.scaling.type") == "yarn":
        values["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": float(header.arch_field("rope.freq_base", 150_000.0)),
            "factor": float(header.arch_field("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": int(header.arch_field("rope.scaling.original_context_length"))}
    return values
