"""A torch-free engine for server tests where the model is not the point (routing, limits,
the access guard): it implements memrad.server.context.ServingEngine and nothing more."""

from __future__ import annotations

from memrad.chat.reply import ReplyDelta
from memrad.protocol import Decision
from memrad.request import Completion


class FakeChat:
    """Characters as tokens; a conversation renders as role-tagged lines; replies are all content."""

    vocab_size = 0x110000

    def render(self, messages, tools, require_call=False, call_name=None):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"
        return text, self.encode(text)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def parser(self, prompt_text, parse_tools, tool_names=None):
        return FakeParser()

    def tool_constraint(self, tools, mode, name, parallel):
        return None  # no call syntax: replies stay free

    def grammar_error(self, constraint):
        return None


class FakeParser:
    def feed(self, text):
        return [ReplyDelta("content", text)] if text else []

    def finish(self):
        return []


class FakeEvents:
    def __init__(self):
        self.sinks = []

    def subscribe(self, sink):
        self.sinks.append(sink)


class FakeEngine:
    """Answers every request with one word per token ("ok "), up to max_tokens (default 4)."""

    model_id = "fake-model"
    context_len = 4096
    runtime_choices = {"dtype": {"value": "none", "reason": "a fake engine"}}

    def __init__(self):
        self.chat = FakeChat()
        self.events = FakeEvents()
        self.requests = []

    def init_worker_thread(self):
        pass

    def generate(self, request, emit, cancelled, on_decision=None):
        self.requests.append(request)
        decision = Decision(request.request_id, "cold", "a fake engine plans nothing", 0, request.num_prompt_tokens)
        if on_decision is not None:
            on_decision(decision)
        words = ["ok "] * (request.sampling.max_tokens or 4)
        for word in words:
            emit(word)
        return Completion(text="".join(words), finish_reason="length", prompt_tokens=request.num_prompt_tokens,
                          completion_tokens=len(words), cached_tokens=0, ttft_s=0.0, total_s=0.0, decision=decision)

    def stats(self):
        return None

    def infos(self):
        return []

    def close(self):
        pass
