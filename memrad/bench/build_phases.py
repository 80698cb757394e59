"""`memrad bench build-phases`: where a decode-step package's build goes, phase by phase.

The harness times inductor's own functions, so it lives beside the build it times
(memrad.engine.decode.build_phases: only the engine imports torch).
"""

from memrad.engine.decode.build_phases import main

__all__ = ["main"]
