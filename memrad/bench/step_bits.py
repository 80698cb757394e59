"""Eager decode step against its compiled form, bit for bit: `memrad bench step-bits`.

    memrad bench step-bits [--model default] [--steps 100] [--emulate-precision-casts]

The question behind exact mode's compile rule (docs/ARCHITECTURE.md, "The decode step"):
could the eager step compute what the compiled one computes, so a reply served before the
background compile lands equals one served after? Both run the model as `auto` loads it
(dtype, weights, memra's attention kernel when built) over the same teacher-forced random
tokens from position 0, each on its own KV slabs; the compiled one is `torch.compile` of the
same step (inductor; the AOTInductor package runs inductor's code, measured bit-identical to
it), optionally with inductor's `emulate_precision_casts`. Prints how many logit rows are
bit-identical, how many argmaxes agree and the largest difference.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str]) -> int:
    from memrad.engine.decode import cpu_attention
    from memrad.engine.decode.step import attended_rows
    from memrad.engine.decode.steps import kv_shape, new_step
    from memrad.engine.model.loader import load_model

    parser = argparse.ArgumentParser(prog="memrad bench step-bits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=100, help="decode positions compared")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--emulate-precision-casts", action="store_true",
                        help="inductor rounds where eager rounds between fused low-precision ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu", progress=lambda _: None)
    kernel = cpu_attention.load(cpu_attention.cxx_compiler()) is None
    step = new_step(loaded.model, args.steps + 1)
    if args.emulate_precision_casts:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    compiled = torch.compile(step, fullgraph=True)
    kv_heads, head_dim = kv_shape(loaded.model.config)
    dtype = next(loaded.model.parameters()).dtype
    tokens = torch.randint(0, loaded.model.config.vocab_size, (args.steps,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    def run(fn, dynamic: bool) -> tuple[torch.Tensor, float]:
        keys = [torch.zeros(1, kv_heads, args.steps + 2, head_dim, dtype=dtype) for _ in step.layers]
        values = [torch.zeros_like(k) for k in keys]
        rows_out = []
        started = time.perf_counter()
        with torch.inference_mode():
            for position, token in enumerate(tokens):
                rows = attended_rows(position + 1, torch.device("cpu"))
                if dynamic:
                    torch._dynamo.mark_dynamic(rows, 0)
                rows_out.append(fn(torch.tensor([token]), torch.tensor([position]), rows, keys, values,
                                   step.owner, kernel).float())
        return torch.stack(rows_out), time.perf_counter() - started  # [steps, V]

    eager, eager_s = run(step, False)
    run(compiled, True)  # compiles
    inductor, inductor_s = run(compiled, True)
    same = sum(bool(torch.equal(a, b)) for a, b in zip(eager, inductor))
    argmax = int((eager.argmax(-1) == inductor.argmax(-1)).sum())
    print(f"model={loaded.model_id} dtype={loaded.dtype_name} weights={loaded.weights_name} kernel={kernel} "
          f"threads={args.threads} emulate_precision_casts={args.emulate_precision_casts}")
    print(f"{args.steps} positions: logit rows bit-identical {same}/{args.steps}, argmax equal {argmax}/{args.steps}, "
          f"max |eager - compiled| {float((eager - inductor).abs().max()):.4g}; "
          f"{eager_s / args.steps * 1e3:.1f} vs {inductor_s / args.steps * 1e3:.1f} ms a step")
    return 0
