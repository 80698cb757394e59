"""A test-only engine whose replies are scripted, behind the real server.

Only next-token choice is replaced: each request's reply is the scripted text encoded by the
real tokenizer, then eos. Rendering, prefill, reuse, parking and affinity all stay real, and
the logits each first token would have been sampled from are recorded (as a digest), so
two runs can be compared bit for bit.
"""

from __future__ import annotations

import hashlib
from collections import deque

import anthropic
import openai

from memrad.engine.engine import Engine

# The tool round trip the agent tests script: one function tool as each API spells it, and
# a reply with reasoning, content and a call in memra's Hermes markup.
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": PARAMS}]
MESSAGES_TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": PARAMS}]
CALL_REPLY = ('<think>\nI should look at the file.\n</think>\n\nLet me read it.\n<tool_call>\n'
              '{"name": "read_file", "arguments": {"path": "src/a.py"}}\n</tool_call>')


def chat_stream_parts(chunks: list) -> tuple[str, str, list, str]:
    """A Chat Completions stream folded: (reasoning, content, tool-call deltas, last finish reason)."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    return reasoning, content, calls, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def messages_answer(messages: list[dict], message, result: str) -> list[dict]:
    """Check that an Anthropic `message` is CALL_REPLY parsed (thinking, text, one tool_use);
    return the conversation after it with the call answered by `result`."""
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = message.content
    assert (thinking.thinking, text.text) == ("I should look at the file.", "Let me read it.")
    assert (use.name, use.input, message.stop_reason) == ("read_file", {"path": "src/a.py"}, "tool_use")
    return messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]


def oai(server) -> openai.AsyncOpenAI:
    """The real OpenAI client against an aiohttp TestServer."""
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)


def claude(server) -> anthropic.AsyncAnthropic:
    """The real Anthropic client against an aiohttp TestServer."""
    return anthropic.AsyncAnthropic(base_url=str(server.make_url("")), api_key="unused", max_retries=0)


class ScriptedEngine(Engine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, sampler=self._next_token, **kwargs)
        self.replies: deque[str] = deque()
        self.prompt_logits: list[str] = []  # sha256 of each request's first logits
        self.prompts: list[tuple[int, ...]] = []  # each request's prompt ids
        self.requests: list = []  # each GenerationRequest, as the server queued it
        self._tokens: deque[int] = deque()
        self._first = False
        self._eos = min(self.loaded.eos_ids)

    def script(self, *replies: str) -> None:
        self.replies.extend(replies)

    def admit(self, request, emit, cancelled, on_decision=None):
        # one request at a time (max_batch 1): its reply is the script's next
        reply = self.replies.popleft() if self.replies else ""
        self._tokens = deque(self.loaded.tokenizer(reply, add_special_tokens=False)["input_ids"])
        self._first = True
        self.prompts.append(request.prompt_ids)
        self.requests.append(request)
        return super().admit(request, emit, cancelled, on_decision)

    def _next_token(self, logits, params, generator) -> int:
        if self._first:
            self.prompt_logits.append(hashlib.sha256(logits.detach().float().numpy().tobytes()).hexdigest())
            self._first = False
        return self._tokens.popleft() if self._tokens else self._eos
