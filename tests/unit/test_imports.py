import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["tui", "tui.cli", "tui.app", "memrad.cli", "memrad.server.app", "memrad.scheduler"])
def test_front_ends_import_no_torch_or_transformers(module):
    code = (f"import sys, {module}; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_memrad_start_checks_the_model_cache_without_torch():
    # `memrad start` asks whether the default model is converted before it starts the daemon;
    # importing torch for that cost 1.1 s of every start (measured).
    code = ("import sys; from memrad.engine.model.pull import default_model_dir, is_converted; "
            "is_converted(default_model_dir()); "
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_tui_uses_nothing_of_memrad_but_the_protocol():
    from pathlib import Path

    tui = Path(__file__).resolve().parents[2] / "tui"
    uses = {line.split()[1] for path in tui.rglob("*.py") for line in path.read_text().splitlines()
            if line.startswith(("from memrad", "import memrad"))}
    assert uses == {"memrad.protocol"}


# The one transformers import outside the engine: the reply parser's schema-driven parsing
# (memrad/chat/parse.py, imported lazily). It is text code; the test below pins that it loads
# no torch, so the chat room stays pure.
CHAT_PARSING = "from transformers.utils.chat_parsing import ResponseParser"


def test_only_the_engine_imports_torch_or_transformers():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = [f"{path.relative_to(root)}: {line.strip()}"
                 for folder in ("memrad", "tui") for path in (root / folder).rglob("*.py")
                 if "engine" not in path.relative_to(root).parts
                 for line in path.read_text().splitlines()
                 if line.strip().startswith(("import torch", "from torch", "import transformers", "from transformers"))
                 and not (path.relative_to(root).as_posix() == "memrad/chat/parse.py" and line.strip() == CHAT_PARSING)]
    assert offenders == []


def test_the_chat_room_loads_no_torch():
    # memrad.chat renders prompts and parses replies; the server reaches it without the engine.
    code = ("import sys, memrad.chat.format, memrad.chat.render, memrad.chat.parse, memrad.chat.detokenize, "
            "memrad.chat.reply, memrad.chat.stops; " + CHAT_PARSING + "; "
            "print(','.join(m for m in ('torch',) if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
