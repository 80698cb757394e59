"""Settings for every test session (unit and integration), made before any test module
(or the conftest files below this one) imports torch."""

import os

from memrad.paths import cache_dir

# Compiled decode steps built by tests (tiny models, daemons) get a directory of their own:
# in memra's compile cache they would push the user's real packages out (it keeps the 8 most
# recently used). It persists between runs, so a second run opens what the first built.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile-tests"))
