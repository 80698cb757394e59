"""The eager decode step against its compiled form, bit for bit (`memrad bench step-bits`).

The question behind exact mode's compile rule (docs/ARCHITECTURE.md, "The decode step"):
could the eager step compute what the compiled one computes, so a reply served before the
background compile lands equals one served after? Both run the model as `auto` loads it
(dtype, weights, memra's attention kernel when built) over the same teacher-forced random
tokens from position 0, each on its own KV slabs; the compiled one is `torch.compile` of the
same step (inductor; the AOTInductor package runs inductor's code, measured bit-identical to
it), optionally with inductor's `emulate_precision_casts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from memrad.engine.kernels import decode_attention
from memrad.engine.kernels.build import cxx_compiler
from memrad.engine.decode.steps.llama import attended_rows
from memrad.engine.decode.steps import kv_shape, new_step
from memrad.engine.model.loader import load_model


@dataclass(frozen=True, slots=True)
class StepBits:
    """How far the compiled step's logits are from the eager step's over `steps` positions."""

    model: str
    dtype: str
    weights: str
    kernel: bool
    steps: int
    identical_rows: int  # logit rows equal bit for bit
    equal_argmax: int
    max_abs_diff: float
    eager_ms: float  # a step, after warm-up for the compiled one
    compiled_ms: float


def compare(spec: str, steps: int, threads: int, emulate_precision_casts: bool) -> StepBits:
    torch.set_num_threads(threads)
    loaded = load_model(spec, device="cpu", progress=lambda _: None)
    kernel = decode_attention.load(cxx_compiler()) is None
    step = new_step(loaded.model, steps + 1)
    if emulate_precision_casts:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    compiled = torch.compile(step, fullgraph=True)
    kv_heads, head_dim = kv_shape(loaded.model.config)
    dtype = next(loaded.model.parameters()).dtype
    tokens = torch.randint(0, loaded.model.config.vocab_size, (steps,), generator=torch.Generator().manual_seed(0))

    def run(fn, dynamic: bool) -> tuple[torch.Tensor, float]:
        keys = [torch.zeros(1, kv_heads, steps + 2, head_dim, dtype=dtype) for _ in step.layers]  # [1, H_kv, S, D]
        values = [torch.zeros_like(k) for k in keys]
        logits = []
        started = time.perf_counter()
        with torch.inference_mode():
            for position, token in enumerate(tokens.tolist()):
                rows = attended_rows(position + 1, torch.device("cpu"))
                if dynamic:
                    torch._dynamo.mark_dynamic(rows, 0)
                logits.append(fn(torch.tensor([token]), torch.tensor([position]), rows, keys, values,
                                 step.owner, kernel).float())
        return torch.stack(logits), (time.perf_counter() - started) / steps * 1e3  # [steps, V], ms a step

    eager, eager_ms = run(step, False)
    run(compiled, True)  # compiles
    inductor, compiled_ms = run(compiled, True)
    return StepBits(loaded.model_id, loaded.dtype_name, loaded.weights_name, kernel, steps,
                    sum(bool(torch.equal(a, b)) for a, b in zip(eager, inductor)),
                    int((eager.argmax(-1) == inductor.argmax(-1)).sum()),
                    float((eager - inductor).abs().max()), eager_ms, compiled_ms)
