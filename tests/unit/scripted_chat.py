"""A torch-free engine with a real chat: the tiny ChatML tokenizer's template, tool format and
reply parser, and scripted replies. For agent-client tests whose prompts (8-20k tokens of
tool definitions) are past the tiny model's 1024 positions: everything up to the engine is
the real path, only the model is not there."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from memrad.chat.chat import Chat
from memrad.protocol import Decision
from memrad.request import Completion, GenerationRequest
from fake_engine import FakeEngine


class ScriptedChatEngine(FakeEngine):
    """Each request's reply is the next queued one, else `reply_for(request)`, else "ok"."""

    model_id = "tiny-chatml"

    def __init__(self, chat: Chat, context_len: int = 1_000_000,
                 reply_for: Callable[[GenerationRequest], str] | None = None) -> None:
        super().__init__()
        self.chat = chat
        self.context_len = context_len
        self.replies: deque[str] = deque()
        self.reply_for = reply_for

    def generate(self, request, emit, cancelled, on_decision=None):
        self.requests.append(request)
        decision = Decision(request.request_id, "cold", "scripted", 0, request.num_prompt_tokens)
        if on_decision is not None:
            on_decision(decision)
        if self.replies:
            text = self.replies.popleft()
        else:
            text = self.reply_for(request) if self.reply_for is not None else "ok"
        emit(text)
        return Completion(text=text, finish_reason="stop", prompt_tokens=request.num_prompt_tokens,
                          completion_tokens=len(self.chat.encode(text)), cached_tokens=0, ttft_s=0.0, total_s=0.0,
                          decision=decision)
