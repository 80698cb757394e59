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
from dataclasses import dataclass
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
    return estimate_of(last_build_s(package))


# What a package build goes through, in order (memrad.engine.decode.package.build; the child
# of memrad.engine.decode.builder loads the model first): a bar without an estimate counts them.
PHASES = ("loading the model", "exporting the graph", "compiling (inductor's codegen, then g++)",
          "writing the package")
BAR_WIDTH = 20


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a build is: what it builds, the last such build's time here (None: never
    measured), and the phase it reached (one of PHASES; None before the first)."""

    what: str  # "the decode step (one row, memra's attention kernel)"
    estimate_s: float | None
    phase: str | None = None

    def line(self, elapsed_s: float) -> str:
        """The bar a terminal redraws each second: against the estimate where there is one,
        else against the phases (never a guess).

            [######..............]  29 s of ~97 s (the last build here); exporting the graph (2/4)
            [#####...............] phase 2/4, exporting the graph; 29 s (no earlier build here to time it by)
        """
        at = PHASES.index(self.phase) if self.phase in PHASES else None
        phase = f"{self.phase} ({at + 1}/{len(PHASES)})" if at is not None else None
        if self.estimate_s is not None:
            if elapsed_s > self.estimate_s:
                fraction, text = 1.0, f"{elapsed_s:3.0f} s, past the ~{self.estimate_s:.0f} s the last build here took"
            else:
                fraction = elapsed_s / self.estimate_s
                text = f"{elapsed_s:3.0f} s of ~{self.estimate_s:.0f} s (the last build here)"
            return f"[{_bar(fraction)}] {text}" + (f"; {phase}" if phase else "")
        where = f"phase {at + 1}/{len(PHASES)}, {self.phase}; " if at is not None else ""
        return f"[{_bar((at or 0) / len(PHASES))}] {where}{elapsed_s:.0f} s ({estimate_of(None)})"


def _bar(fraction: float) -> str:
    filled = round(fraction * BAR_WIDTH)
    return "#" * filled + "." * (BAR_WIDTH - filled)


def estimate_of(seconds: float | None) -> str:
    """An estimate in words: '~412 s (the last build here)' or 'no earlier build here to time it by'."""
    return f"~{seconds:.0f} s (the last build here)" if seconds is not None else "no earlier build here to time it by"
