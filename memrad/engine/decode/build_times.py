"""How long the decode step's packages took to build here: kept in the compile cache, read for estimates.

    compile/build-times.json   {"decode-step-SmolLM2-135M-Instruct-int4-bfloat16-attn-memra-torch2.13.0_cpu-avx512": 412.3,
                                "decode-step-SmolLM2-135M-Instruct-rows2-...": 530.1, ...}

A package's name ends with a key of everything it was compiled from (memrad.engine.decode.package);
the name without that key (its family: model, rows, weights, dtype, attention, torch, CPU kind)
changes rarely, so the last build of the same family on this machine is what `memrad pull` and
a first start quote as the wait ahead. Nothing measured here yet says so; it never guesses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FILE = "build-times.json"


def family(package: Path) -> str:
    """The package's name without its key: `decode-step-...-avx512` of `decode-step-...-avx512-<hex>.pt2`."""
    return re.sub(r"-[0-9a-f]{16}$", "", package.stem)


def _read(directory: Path) -> dict[str, float]:
    try:
        data = json.loads((directory / FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def record(package: Path, seconds: float) -> None:
    """Keep `seconds` as the last build time of `package`'s family (mutates the cache file;
    a write that fails loses only an estimate)."""
    times = _read(package.parent)
    times[family(package)] = round(seconds, 1)
    temporary = package.parent / f".{FILE}.tmp"
    try:
        temporary.write_text(json.dumps(times, indent=1, sort_keys=True))
        temporary.replace(package.parent / FILE)
    except OSError:
        pass


def last_build_s(package: Path) -> float | None:
    """The last build time of `package`'s family here, None where none was measured."""
    return _read(package.parent).get(family(package))


def estimate(package: Path) -> str:
    """The wait ahead in words: '~412 s (the last build here)' or 'no earlier build here to time it by'."""
    seconds = last_build_s(package)
    return f"~{seconds:.0f} s (the last build here)" if seconds is not None else "no earlier build here to time it by"
