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
import json
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
REPLY_CAP = Settings().limits.max_reply_tokens  # what a max_tokens past it is lowered to
ANSWER = "The sandbox holds README.md and hello.py."


def needs(cli: str) -> None:
    if not (BIN / cli).exists():
        pytest.skip(f"{BIN / cli} is missing: run `npm install --prefix tests/agent_clis --no-audit --no-fund`")


def all_2xx(counts: dict) -> bool:
    return bool(counts) and all(status.startswith("2") for _, status in counts)


def reply_for(shell_tool: str, arguments: str, result_marker: str = "<tool_response>"):
    """The scripted model: call the shell tool once, then answer from its result (what
    follows the last `result_marker`)."""

    def reply(request) -> str:
        text = request.prompt_text
        if result_marker in text and "hello.py" in text.rsplit(result_marker, 1)[1]:
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


def invocation(cli: str, home: Path) -> tuple[list[str], dict]:
    """The tested configuration of each CLI (docs/SERVING.md): (argv, environment). The port
    is known once the server runs, so the shell writes it in from $PORT."""
    home.mkdir()
    prompt = '"list the files here"'
    if cli == "claude":
        return (["sh", "-c", f"ANTHROPIC_BASE_URL=http://127.0.0.1:$PORT exec claude -p {prompt}"],
                {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_API_KEY": "dummy",
                 "ANTHROPIC_MODEL": "default", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"})
    if cli == "codex":
        (home / "config.toml").write_text(
            'model = "default"\nmodel_provider = "memra"\n\n[model_providers.memra]\nname = "memra"\n'
            'base_url = "http://127.0.0.1:PORT/v1"\nenv_key = "MEMRA_API_KEY"\nwire_api = "responses"\n')
        return (["sh", "-c", f'sed -i "s/PORT/$PORT/" "$CODEX_HOME/config.toml" && exec codex exec {prompt}'],
                {"HOME": str(home), "CODEX_HOME": str(home), "MEMRA_API_KEY": "dummy"})
    if cli == "qwen":
        return (["sh", "-c", f"OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1 exec qwen -p {prompt}"],
                {"HOME": str(home), "OPENAI_API_KEY": "dummy", "OPENAI_MODEL": "default"})
    (home / "opencode.json").write_text(
        '{"$schema": "https://opencode.ai/config.json", "provider": {"memra": {"npm": '
        '"@ai-sdk/openai-compatible", "name": "memra", "options": {"baseURL": "http://127.0.0.1:PORT/v1", '
        '"apiKey": "dummy"}, "models": {"default": {"name": "default"}}}}, "model": "memra/default"}')
    xdg = {f"XDG_{kind}_HOME": str(home / kind.lower()) for kind in ("CONFIG", "DATA", "CACHE", "STATE")}
    return (["sh", "-c", f'sed -i "s/PORT/$PORT/" "$OPENCODE_CONFIG" && exec opencode run {prompt}'],
            {"HOME": str(home), "OPENCODE_CONFIG": str(home / "opencode.json"), **xdg})


async def run_cli(engine, cli: str, tmp_path: Path, env_set: dict | None = None) -> tuple[int, str, str, dict]:
    """Run `cli` in a fresh sandbox against a fresh server, its tested configuration's
    environment updated by `env_set`; (exit code, stdout, stderr, request counts by (route,
    status))."""
    needs(cli)
    work = sandbox(tmp_path)
    argv, env = invocation(cli, tmp_path / "home")
    env.update(env_set or {})
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        env = {"PATH": f"{BIN}:{os.environ['PATH']}", "PORT": str(server.port), **env}
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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


async def run_task(cli: str, tmp_path: Path, tool: str, arguments: dict, context_len: int = 1_000_000,
                   chat: Chat | None = None, generation_prompt: str = "<|im_start|>assistant\n",
                   result_marker: str = "<tool_response>", env_set: dict | None = None) -> tuple:
    """The tool task: the CLI exits 0, prints the answer, and every request was 2xx; (engine,
    the requests whose prompt offers `tool`, request counts). `chat`: the tokenizer and
    template (the tiny ChatML one unless given), whose reply opens with `generation_prompt`
    and whose tool results follow `result_marker`."""
    engine = ScriptedChatEngine(chat or Chat(build_tokenizer()), context_len=context_len,
                                reply_for=reply_for(tool, json.dumps(arguments), result_marker))
    code, out, err, counts = await run_cli(engine, cli, tmp_path, env_set)
    assert code == 0, err
    assert ANSWER in out and all_2xx(counts), counts
    main = [r for r in engine.requests if f'"name": "{tool}"' in r.prompt_text]
    assert len(main) >= 2 and result_marker in main[1].prompt_text
    # Turn 2 renders turn 1 as an exact prefix.
    assert main[0].prompt_text.endswith(generation_prompt)
    assert main[1].prompt_text.startswith(main[0].prompt_text[:-len(generation_prompt)])
    return engine, main, counts


async def test_claude_code_runs_bash_and_answers(tmp_path):
    # 100k tokens of context: its ~70k-token prompt fits, its max_tokens 32000 does not.
    engine, main, counts = await run_task("claude", tmp_path, "Bash", {"command": "ls", "description": "List"},
                                          context_len=100_000)
    assert counts[("/", "200")] >= 1  # the HEAD preflight
    assert len(main) == 2  # the call, then the answer after the result (cache_control moved, bytes did not)
    assert "<tool_response>\nREADME.md\nhello.py" in main[1].prompt_text
    assert {r.identity.source for r in main} == {"metadata.user_id"}
    assert [r.sampling.max_tokens for r in main] == [min(REPLY_CAP, 100_000 - len(r.prompt_ids)) for r in main]


async def test_codex_exec_runs_exec_command_and_answers(tmp_path):
    engine, main, _ = await run_task("codex", tmp_path, "exec_command", {"cmd": "ls"})
    assert len(engine.requests) == len(main) == 2  # Codex re-sends its output items verbatim
    assert "hello.py" in main[1].prompt_text.split("<tool_response>")[-1]
    assert {r.identity.source for r in main} == {"prompt_cache_key"}


async def test_qwen_code_lists_the_directory_and_answers(tmp_path):
    # Its ~53k-token prompt fits in 60k, its max_tokens 8000 does not.
    _, main, _ = await run_task("qwen", tmp_path, "list_directory", {"path": str(tmp_path / "sandbox")},
                                context_len=60_000)
    assert main[0].sampling.max_tokens == min(REPLY_CAP, 60_000 - len(main[0].prompt_ids))
    assert main[0].identity is None  # Qwen Code names no session


async def test_opencode_reads_the_directory_and_answers(tmp_path):
    # Its ~24k-token prompt fits in 40k, its max_tokens 32000 does not: refusing that made it loop.
    engine, main, _ = await run_task("opencode", tmp_path, "read", {"filePath": str(tmp_path / "sandbox")},
                                     context_len=40_000)
    assert len(main) == 2
    assert {r.identity.source for r in engine.requests} == {"x-session-id"}
    assert [r.sampling.max_tokens for r in main] == [min(REPLY_CAP, 40_000 - len(r.prompt_ids)) for r in main]


@pytest.mark.parametrize("cli, said, counts", [
    # Claude Code reads "prompt is too long: N tokens > M maximum" and says why it cannot compact.
    ("claude", "Prompt is too long", {("/", "200"): 1, ("/v1/messages", "200"): 1, ("/v1/messages", "400"): 1}),
    # Codex reads context_length_exceeded as final.
    ("codex", "ran out of room in the model's context window", {("/v1/responses", "400"): 1}),
    # Qwen Code compresses the history once (served), retries once, and stops.
    ("qwen", "maximum context length is 10000 tokens", {("/v1/chat/completions", "400"): 2,
                                                        ("/v1/chat/completions", "200"): 1}),
])
async def test_a_prompt_that_alone_overflows_stops_the_cli_without_a_loop(tmp_path, cli, said, counts):
    engine = ScriptedChatEngine(Chat(build_tokenizer()), context_len=10_000, reply_for=lambda request: "Summary.")
    code, out, err, got = await run_cli(engine, cli, tmp_path)
    assert code == 1 and said in out + err
    assert got == counts


@pytest.fixture(scope="module")
def gemma_chat():
    """gemma3-270m's real tokenizer and template (no tool format: memra's tool convention)."""
    from memrad.engine.model.catalog import GEMMA3_270M
    from memrad.engine.model.pull import model_dir

    folder = model_dir(GEMMA3_270M)
    if not (folder / "tokenizer.json").exists():
        pytest.skip("gemma3-270m is not pulled: run `memrad pull gemma3-270m` (.ci/run does)")
    from transformers import AutoTokenizer

    return Chat(AutoTokenizer.from_pretrained(folder))


# Every CLI's first prompt fits gemma3-270m's 32,768 in Gemma's tokens, tools in memra's convention:
# Claude Code ~22.1k with ANTHROPIC_MODEL=default (a `claude-` model name makes it send its fuller
# prompt, ~30.8k, which fits too), Qwen Code ~15.9k, Codex ~8.9k, opencode ~7.5k.
@pytest.mark.parametrize("cli, tool, arguments", [
    ("claude", "Bash", {"command": "ls", "description": "List"}),
    ("codex", "exec_command", {"cmd": "ls"}),
    ("qwen", "list_directory", {"path": "SANDBOX"}),
    ("opencode", "read", {"filePath": "SANDBOX"}),
])
async def test_every_cli_runs_its_tool_on_gemma3_through_memras_tool_convention(tmp_path, gemma_chat, cli, tool,
                                                                                 arguments):
    # Gemma 3's template has no tool format: the definitions go with the system text (which opens
    # the first user turn), calls are <tool_call> JSON in the model's turn, results a `tool` turn
    # in Gemma's own markup.
    arguments = {k: str(tmp_path / "sandbox") if v == "SANDBOX" else v for k, v in arguments.items()}
    _, main, _ = await run_task(cli, tmp_path, tool, arguments, context_len=32_768, chat=gemma_chat,
                                generation_prompt="<start_of_turn>model\n", result_marker="<start_of_turn>tool\n")
    assert "# Tools" in main[0].prompt_text.split("<start_of_turn>model\n", 1)[0]
    assert f'<start_of_turn>model\n<tool_call>\n{{"name": "{tool}"' in main[1].prompt_text


async def test_claude_codes_fuller_prompt_under_a_claude_model_name_fits_gemma3_too(tmp_path, gemma_chat):
    # A `claude-` model name of the 4.5 generation on makes Claude Code send its longer system
    # prompt and tool descriptions: ~30.8k Gemma tokens in memra's one-line JSON, which fits
    # 32,768 (llama.cpp's indent-2 rendering of the same tools would be ~33.3k: a 400).
    _, main, _ = await run_task("claude", tmp_path, "Bash", {"command": "ls"}, context_len=32_768, chat=gemma_chat,
                                generation_prompt="<start_of_turn>model\n", result_marker="<start_of_turn>tool\n",
                                env_set={"ANTHROPIC_MODEL": "claude-sonnet-4-5"})
    assert 30_000 < len(main[0].prompt_ids) < len(main[1].prompt_ids) < 32_768
