"""The real agent CLIs on the real gemma3-270m weights (issue 21's done-when: `memrad start
--model gemma3-270m` serves the same CLIs with tools): every request each CLI makes is 2xx.

Gemma 3's template has no tool format, so every tool the CLIs send reaches the model through
memra's tool convention (memrad/chat/convention.py; `tools.fallback = false` would make each
of these requests a 400). gemma3-270m serves its native 32,768 tokens, which holds every
CLI's first prompt in Gemma's tokens (the tested configurations: Claude Code ~22.1k, Qwen
Code ~15.9k, Codex ~8.9k, opencode ~7.5k; docs/BENCHMARKS.md#agent-clis).
Replies are capped at 64 tokens (MEMRA_MAX_REPLY_TOKENS) to keep CI's time: the base model
rambles to whatever cap it gets, and Claude Code asks for three continuations of a reply
cut at the cap. Each run is measured between two idle daemons (tests/integration/cli_runs.py).
"""

from __future__ import annotations

import pytest

from cli_runs import assert_every_request_served, run_cli

REPLY_CAP = 64
# A lower bound on each CLI's first prompt in Gemma's tokens (docs/BENCHMARKS.md#agent-clis).
FIRST_PROMPT = {"claude": 20_000, "qwen": 14_000, "codex": 8_000, "opencode": 6_500}


@pytest.fixture(scope="module")
def daemon(make_daemon):
    from memrad.engine.model.catalog import GEMMA3_270M
    from memrad.engine.model.pull import is_converted, model_dir

    if not is_converted(model_dir(GEMMA3_270M)):
        pytest.skip("gemma3-270m is not in the cache: run `memrad pull gemma3-270m` (.ci/run does)")
    d = make_daemon()
    d.env.update(MEMRA_MODEL=GEMMA3_270M.name, MEMRA_MAX_REPLY_TOKENS=str(REPLY_CAP))
    result = d.start()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{d.log_text()[-3000:]}"
    return d


@pytest.mark.parametrize("cli", ["opencode", "codex", "qwen", "claude"])
def test_the_cli_runs_its_tools_on_gemma3_and_every_request_is_served(daemon, tmp_path, cli):
    model = daemon.get_json("/v1/models")["data"][0]
    assert (model["id"], model["context_length"]) == ("gemma3-270m", 32768)
    run = run_cli(daemon, tmp_path, cli)
    assert_every_request_served(run)
    # The CLI's first prompt, its tools in memra's convention, fit Gemma's native context.
    assert FIRST_PROMPT[cli] < max(run.prompt_tokens()) < 32768
