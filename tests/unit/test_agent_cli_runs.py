"""The real Claude Code, Codex, Qwen Code and opencode binaries, pinned in tests/agent_clis/package.json, run a tool
task against memrad (issue 20, item 6).

Each CLI runs non-interactively with only the base URL, the model and a dummy key set
(the configurations of docs/SERVING.md "Use with agent CLIs"): the model calls the CLI's own
shell tool, the CLI runs `ls` in a sandbox and sends the result, the model answers, the CLI
prints the answer and exits 0, and every request it made was answered 2xx. The engine is
scripted (tests/unit/scripted_chat.py): the tokenizer, chat template, tool format, reply
parser and the whole server are real; the replies are chosen from what the prompt holds.

Skipped when `npm install --prefix tests/agent_clis` has not been run (.ci/run runs it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from memrad.chat.chat import Chat
from memrad.config import Settings
from memrad.server.app import make_app
from memrad.server.metrics import parse_samples
from scripted_chat import ScriptedChatEngine
from tiny import build_tokenizer

BIN = Path(__file__).resolve().parents[1] / "agent_clis" / "node_modules" / ".bin"
ANSWER = "The sandbox holds README.md and hello.py."


def needs(cli: str) -> None:
    if not (BIN / cli).exists():
        pytest.skip(f"{BIN / cli} is missing: run `npm install --prefix tests/agent_clis --no-audit --no-fund`")


def reply_for(shell_tool: str, arguments: str):
    """The scripted model: call the shell tool once, then answer from its result."""

    def reply(request) -> str:
        text = request.prompt_text
        if "<tool_response>" in text and "hello.py" in text.rsplit("<tool_response>", 1)[1]:
            return ANSWER
        if f'"name": "{shell_tool}"' in text:
            return f'<tool_call>\n{{"name": "{shell_tool}", "arguments": {arguments}}}\n</tool_call>'
        return "Files"  # a side query (Claude Code's title)

    return reply


def sandbox(root: Path) -> Path:
    work = root / "sandbox"
    work.mkdir()
    (work / "README.md").write_text("# sandbox\n")
    (work / "hello.py").write_text('print("hello")\n')
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    return work


async def run_cli(engine, argv: list[str], env: dict, cwd: Path) -> tuple[int, str, str, dict]:
    """Run the CLI against a fresh server; (exit code, stdout, stderr, request counts by
    (route, status))."""
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        env = {"PATH": f"{BIN}:{os.environ['PATH']}", "PORT": str(server.port), **env}
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 180)
        except TimeoutError:
            proc.kill()
            raise
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/metrics")) as resp:
                samples = parse_samples(await resp.text())
    finally:
        await server.close()
    counts = {(dict(labels)["route"], dict(labels)["status"]): value for (name, labels), value in samples.items()
              if name == "memra_http_requests_total" and dict(labels)["route"] != "/metrics"}
    return proc.returncode, out.decode(), err.decode(), counts


async def test_claude_code_runs_bash_and_answers(tmp_path):
    needs("claude")
    engine = ScriptedChatEngine(Chat(build_tokenizer()),
                                reply_for=reply_for("Bash", '{"command": "ls", "description": "List files"}'))
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_API_KEY": "dummy",
           "ANTHROPIC_MODEL": "default", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}
    work = sandbox(tmp_path)
    # The port is known once the server runs: the shell sets the base URL from $PORT.
    code, out, err, counts = await run_cli(
        engine, ["sh", "-c", 'ANTHROPIC_BASE_URL=http://127.0.0.1:$PORT exec claude -p "list the files here"'], env, work)
    assert code == 0, err
    assert ANSWER in out
    assert all(status.startswith("2") for _, status in counts), counts
    assert counts[("/", "200")] >= 1  # the HEAD preflight
    main = [r for r in engine.requests if '"name": "Bash"' in r.prompt_text]
    assert len(main) == 2  # the call, then the answer after the result
    # Turn 2 renders turn 1 as an exact prefix (cache_control moved, the bytes did not).
    assert main[1].prompt_text.startswith(main[0].prompt_text[:-len("<|im_start|>assistant\n")])
    assert "<tool_response>\nREADME.md\nhello.py" in main[1].prompt_text
    assert {r.identity.source for r in main} == {"metadata.user_id"}


async def test_codex_exec_runs_exec_command_and_answers(tmp_path):
    needs("codex")
    engine = ScriptedChatEngine(Chat(build_tokenizer()), reply_for=reply_for("exec_command", '{"cmd": "ls"}'))
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "default"\nmodel_provider = "memra"\n\n[model_providers.memra]\nname = "memra"\n'
        'base_url = "http://127.0.0.1:PORT/v1"\nenv_key = "MEMRA_API_KEY"\nwire_api = "responses"\n')
    work = sandbox(tmp_path)
    code, out, err, counts = await run_cli(
        engine, ["sh", "-c", 'sed -i "s/PORT/$PORT/" "$CODEX_HOME/config.toml" && exec codex exec "list the files here"'],
        {"HOME": str(tmp_path), "CODEX_HOME": str(home), "MEMRA_API_KEY": "dummy"}, work)
    assert code == 0, err
    assert ANSWER in out
    assert counts and all(status.startswith("2") for _, status in counts), counts
    assert len(engine.requests) == 2
    first, second = (r.prompt_text for r in engine.requests)
    assert second.startswith(first[:-len("<|im_start|>assistant\n")])  # Codex re-sends output items verbatim
    assert "<tool_response>\n" in second and "hello.py" in second.split("<tool_response>")[-1]
    assert {r.identity.source for r in engine.requests} == {"prompt_cache_key"}


async def test_qwen_code_lists_the_directory_and_answers(tmp_path):
    needs("qwen")
    work = sandbox(tmp_path)
    engine = ScriptedChatEngine(Chat(build_tokenizer()),
                                reply_for=reply_for("list_directory", f'{{"path": "{work}"}}'))
    home = tmp_path / "home"
    home.mkdir()
    code, out, err, counts = await run_cli(
        engine, ["sh", "-c", 'OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1 exec qwen -p "list the files here"'],
        {"HOME": str(home), "OPENAI_API_KEY": "dummy", "OPENAI_MODEL": "default"}, work)
    assert code == 0, err
    assert ANSWER in out
    assert counts and all(status.startswith("2") for _, status in counts), counts
    main = [r for r in engine.requests if '"name": "list_directory"' in r.prompt_text]
    assert len(main) >= 2 and "<tool_response>" in main[1].prompt_text
    assert main[1].prompt_text.startswith(main[0].prompt_text[:-len("<|im_start|>assistant\n")])
    assert main[0].sampling.max_tokens == 8000 and main[0].identity is None  # Qwen Code names no session


async def test_opencode_reads_the_directory_and_answers(tmp_path):
    needs("opencode")
    work = sandbox(tmp_path)
    engine = ScriptedChatEngine(Chat(build_tokenizer()), reply_for=reply_for("read", f'{{"filePath": "{work}"}}'))
    home = tmp_path / "home"
    home.mkdir()
    config = ('{"$schema": "https://opencode.ai/config.json", "provider": {"memra": {"npm": '
              '"@ai-sdk/openai-compatible", "name": "memra", "options": {"baseURL": "http://127.0.0.1:PORT/v1", '
              '"apiKey": "dummy"}, "models": {"default": {"name": "default"}}}}, "model": "memra/default"}')
    (home / "opencode.json").write_text(config)
    xdg = {f"XDG_{kind}_HOME": str(home / kind.lower()) for kind in ("CONFIG", "DATA", "CACHE", "STATE")}
    code, out, err, counts = await run_cli(
        engine, ["sh", "-c", 'sed -i "s/PORT/$PORT/" "$OPENCODE_CONFIG" && exec opencode run "list the files here"'],
        {"HOME": str(home), "OPENCODE_CONFIG": str(home / "opencode.json"), **xdg}, work)
    assert code == 0, err
    assert ANSWER in out
    assert counts and all(status.startswith("2") for _, status in counts), counts
    main = [r for r in engine.requests if '"name": "read"' in r.prompt_text]
    assert len(main) == 2 and "<tool_response>" in main[1].prompt_text
    assert {r.identity.source for r in engine.requests} == {"x-session-id"}
