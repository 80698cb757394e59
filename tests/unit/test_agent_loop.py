"""6c: a 6-turn agent loop whose client drops reasoning from earlier turns, on each API.

From turn 3 on every turn resumes (cached >= the previous prompt minus one prefill chunk);
with every non-extension reuse tier off the same turns re-prime; in exact mode the logits
each reply starts from are bit-identical between the arms, and so are the replies.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from memrad.engine.engine import EngineOptions
from memrad.config import Settings
from memrad.engine.model.loader import load_model
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app
from scripted import ScriptedEngine
from tiny import build_llama, build_tokenizer

CHUNK = 16
TURNS = 6
SYSTEM = "You are a coding agent. Use tools."
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def extension_tiers_only(engine) -> None:
    """Turn off every reuse tier that does not need the prompt to extend parked tokens
    (MEMRA_AFFINITY=0, MEMRA_LONGEST_PREFIX=0). Extend this when a new such tier lands."""
    engine.affinity = False
    engine.longest_prefix = False


def reply(turn: int) -> tuple[str, str, str]:
    """(reasoning, text, the whole scripted reply) of one turn; the last turn calls no tool."""
    reasoning, text = f"Turn {turn}: I should check file {turn}.", f"Reading f{turn}.py."
    if turn == TURNS:
        return reasoning, "All files are fine.", f"<think>\n{reasoning}\n</think>\n\nAll files are fine."
    call = json.dumps({"name": "read_file", "arguments": {"path": f"f{turn}.py"}})
    return reasoning, text, f"<think>\n{reasoning}\n</think>\n\n{text}\n<tool_call>\n{call}\n</tool_call>"


def result(turn: int) -> str:
    return f"def f{turn}(x):\n    return x + {turn}\n"


@pytest.fixture(scope="module")
def long_loaded(tmp_path_factory):
    """The tiny llama with room for six turns of tool use."""
    folder = tmp_path_factory.mktemp("tiny-long")
    tokenizer = build_tokenizer()
    build_llama(len(tokenizer), max_positions=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype="float32")


class Chat:
    def __init__(self, url):
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Check my files."}]

    async def turn(self):
        r = await self.client.chat.completions.create(
            model="default", messages=self.messages, temperature=0,
            tools=[{"type": "function", "function": {"name": "read_file", "parameters": PARAMS}}])
        m = r.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in m.tool_calls or []]
        # The client keeps the text and the calls, and drops reasoning_content.
        self.messages.append({"role": "assistant", "content": m.content or "", **({"tool_calls": calls}
                                                                                   if calls else {})})
        return m.content, [c["function"]["arguments"] for c in calls], r.usage.prompt_tokens, \
            r.usage.prompt_tokens_details.cached_tokens, r.memra["decision"]

    def add_result(self, call_index, text):
        self.messages.append({"role": "tool", "tool_call_id": self.messages[-1]["tool_calls"][0]["id"],
                              "content": text})


class Responses:
    def __init__(self, url):
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        self.items = [{"role": "user", "content": "Check my files."}]

    async def turn(self):
        r = await self.client.responses.create(model="default", instructions=SYSTEM, input=self.items, temperature=0,
                                               tools=[{"type": "function", "name": "read_file", "parameters": PARAMS}])
        calls = [item for item in r.output if item.type == "function_call"]
        # Reasoning items are dropped; the message and the calls go back.
        self.items += [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": r.output_text}]}]
        self.items += [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                       for c in calls]
        return r.output_text, [c.arguments for c in calls], r.usage.input_tokens, \
            r.usage.input_tokens_details.cached_tokens, r.memra["decision"]

    def add_result(self, call_index, text):
        self.items.append({"type": "function_call_output", "call_id": self.items[-1]["call_id"], "output": text})


class Messages:
    def __init__(self, url):
        self.client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        self.messages = [{"role": "user", "content": "Check my files."}]

    async def turn(self):
        m = await self.client.messages.create(model="default", system=SYSTEM, messages=self.messages, max_tokens=300,
                                              tools=[{"name": "read_file", "input_schema": PARAMS}])
        # Thinking blocks are dropped; text and tool_use go back.
        kept = [b.model_dump(exclude_none=True) for b in m.content if b.type != "thinking"]
        self.messages.append({"role": "assistant", "content": kept})
        text = "".join(b.text for b in m.content if b.type == "text")
        uses = [b for b in m.content if b.type == "tool_use"]
        return text, [json.dumps(b.input) for b in uses], m.usage.input_tokens + m.usage.cache_read_input_tokens, \
            m.usage.cache_read_input_tokens, m.memra["decision"]

    def add_result(self, call_index, text):
        use = self.messages[-1]["content"][-1]
        self.messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                          "content": text}]})


async def run_loop(loaded, api, affinity: bool):
    engine = ScriptedEngine(loaded, EngineOptions(CHUNK, 1), ReusePool(8, 1 << 30))
    if not affinity:
        extension_tiers_only(engine)
    engine.script(*(reply(t)[2] for t in range(1, TURNS + 1)))
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        client = api(str(server.make_url("")).rstrip("/"))
        turns = []
        for t in range(1, TURNS + 1):
            turns.append(await client.turn())
            if t < TURNS:
                client.add_result(0, result(t))
    finally:
        await server.close()
    return turns, engine.prompt_logits


@pytest.mark.parametrize("api", [Chat, Responses, Messages], ids=["chat", "responses", "messages"])
async def test_an_agent_that_drops_reasoning_resumes_every_turn_from_the_third(long_loaded, api):
    on, on_logits = await run_loop(long_loaded, api, affinity=True)
    off, off_logits = await run_loop(long_loaded, api, affinity=False)
    for t in range(1, TURNS + 1):
        text, arguments, _, _, _ = on[t - 1]
        assert text == reply(t)[1]
        assert [json.loads(a) for a in arguments] == ([{"path": f"f{t}.py"}] if t < TURNS else [])
    for t in range(3, TURNS + 1):
        prompt, cached, decision = on[t - 1][2:]
        previous_prompt = on[t - 2][2]
        assert decision.startswith("affinity: resumed"), (t, decision)
        assert cached >= previous_prompt - CHUNK, (t, cached, previous_prompt)
        assert prompt > previous_prompt
        assert off[t - 1][3] == 0, (t, off[t - 1][4])  # the same turn re-primes
    # Same prompts, same replies; in exact mode every reply starts from bit-identical logits.
    assert [turn[:3] for turn in on] == [turn[:3] for turn in off]
    assert on_logits == off_logits and len(on_logits) == TURNS
