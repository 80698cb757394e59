"""A real agent CLI on the real default model with its default settings (issue 20, item 6).

opencode's main prompt (7,733 tokens of SmolLM2's) fits the default model's context and its
`max_tokens: 32000` does not: memrad lowers it to the room left instead of refusing (the
refusal made opencode compact and retry forever).

The daemon here serves the model's native 8,192 (`MEMRA_CONTEXT=8192`): at the default
32,768 the room left is ~25k tokens, which the 135M model fills rambling for many minutes
(the run passed 600 s). 8,192 keeps the lowering visible (to ~459) and the run ~2 minutes.

Measured on this machine (2-core Xeon, fp32/bf16 auto): ~105 s, two requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_agent_cli_runs import BIN, invocation, needs, sandbox  # noqa: E402


@pytest.fixture(scope="module")
def daemon(make_daemon):
    d = make_daemon()
    d.env["MEMRA_CONTEXT"] = "8192"
    result = d.start()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{d.log_text()[-3000:]}"
    return d


def test_opencode_runs_on_the_default_model_and_every_request_is_served(daemon, tmp_path):
    needs("opencode")
    work = sandbox(tmp_path)
    argv, env = invocation("opencode", tmp_path / "home")
    run = subprocess.run(argv, cwd=work, env={"PATH": f"{BIN}:{os.environ['PATH']}", "PORT": str(daemon.port), **env},
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()  # the model's answer, whatever the tiny model says
    served = [line for line in daemon.log_text().splitlines() if " prompt=" in line and "chatcmpl-" in line]
    assert len(served) >= 2  # the title request and the main turn
    assert "refused" not in daemon.log_text()
    main = max(served, key=lambda line: int(line.split(" prompt=")[1].split()[0]))
    prompt, completion = (int(main.split(f" {key}=")[1].split()[0]) for key in ("prompt", "completion"))
    context = daemon.get_json("/v1/models")["data"][0]["context_length"]
    # max_tokens 32000 was lowered to the room left: the reply ran to the end of the context at most.
    assert prompt + completion <= context and prompt > 4000
