"""A test-only engine whose replies are scripted, behind the real server.

Only next-token choice is replaced: each request's reply is the scripted text encoded by the
real tokenizer, then eos. Rendering, prefill, reuse, parking and affinity all stay real, and
the logits each first token would have been sampled from are recorded (as a digest), so
two runs can be compared bit for bit.
"""

from __future__ import annotations

import hashlib
from collections import deque

from memrad.engine.engine import Engine


class ScriptedEngine(Engine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, sampler=self._next_token, **kwargs)
        self.replies: deque[str] = deque()
        self.prompt_logits: list[str] = []  # sha256 of each request's first logits
        self.prompts: list[tuple[int, ...]] = []  # each request's prompt ids
        self._tokens: deque[int] = deque()
        self._first = False
        self._eos = min(self.loaded.eos_ids)

    def script(self, *replies: str) -> None:
        self.replies.extend(replies)

    def generate(self, request, emit, cancelled, on_decision=None):
        reply = self.replies.popleft() if self.replies else ""
        self._tokens = deque(self.loaded.tokenizer(reply, add_special_tokens=False)["input_ids"])
        self._first = True
        self.prompts.append(request.prompt_ids)
        return super().generate(request, emit, cancelled, on_decision)

    def _next_token(self, logits, params, generator) -> int:
        if self._first:
            self.prompt_logits.append(hashlib.sha256(logits.detach().float().numpy().tobytes()).hexdigest())
            self._first = False
        return self._tokens.popleft() if self._tokens else self._eos
