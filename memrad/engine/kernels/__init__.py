"""memra's C++ kernels: their sources (csrc/), one way to build them (build), a module per kernel.

    decode_attention    memra::decode_attention   the decode steps' attention (any CPU capability)
    prefill_attention   memra::prefill_attention  a prefill chunk's attention (AMX, AVX512-BF16; fp32 on AVX512, AVX2)
    block_gemv          memra::block_gemv         a GGUF's blocks as shipped (Q8_0 ... Q6_K, MXFP4; AVX512, AVX2)
    sliced_linear       memra::sliced_linear      a prefill chunk's dense products, the same bits at any count

Each module builds its kernel the first time it is asked to load it; `prepare()` builds every
kernel this machine runs ahead of time (`memrad pull`), so a first start only loads them.
"""

from __future__ import annotations

from collections.abc import Callable


def prepare(say: Callable[[str], None] = print) -> None:
    """Build each kernel this machine runs now unless the cache has it, and `say` how it went.
    Never raises: a kernel that does not build only loses speed (its module says why at load)."""
    from memrad.engine.kernels import block_gemv, decode_attention, prefill_attention, sliced_linear
    from memrad.engine.kernels.build import capability, cxx_compiler

    compiler = cxx_compiler()
    if compiler is None or not decode_attention.built(compiler):
        say("building the CPU decode-attention kernel (once per machine and torch) ...")
        why_not = decode_attention.load(compiler)
        say(f"attention kernel: {'built' if why_not is None else f'not built ({why_not}); decode uses torch attention'}")
    if capability() in ("AVX512", "AVX2") and compiler is not None and not prefill_attention.built(compiler):
        say("building the CPU prefill-attention kernel (once per machine and torch) ...")
        why_not = prefill_attention.load()
        say(f"prefill kernel: {'built' if why_not is None else f'not built ({why_not}); prefill uses torch attention'}")
    if capability() in ("AVX512", "AVX2") and compiler is not None and not block_gemv.built(compiler):
        say("building memra's block kernel (once per machine and torch) ...")
        why_not = block_gemv.why_not()
        say(f"block kernel: {'built' if why_not is None else f'not built ({why_not}); its blocks run on the int4 kernel'}")
    if compiler is not None and not sliced_linear.built(compiler):
        say("building memra's sliced product for prefill (once per machine and torch) ...")
        why_not = sliced_linear.load()
        say(f"sliced product: {'built' if why_not is None else f'not built ({why_not}); prefill keeps its thread count'}")
