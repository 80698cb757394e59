"""The engine: one request at a time, prefill on the grid, decode, hand the state on.

    request -> prefill(prompt) -> [prompt checkpoint] -> sample -> feed -> sample -> ... -> finish
                                        ^ captured before the first generated token is fed
                                          back (the "init feed"): a client that strips the
                                          reply sends back exactly the prompt, never that token.

When a request ends (finished, stopped, or cancelled) its cache state and token history go
to `on_finished`, the hook the reuse pool parks from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memrad.engine.detokenize import IncrementalDetokenizer
from memrad.engine.forward import cache_length, decode_one_token, prefill
from memrad.engine.loader import LoadedModel
from memrad.engine.prompt import encode_text, render_chat
from memrad.engine.sampling import make_generator, sample
from memrad.request import Completion, FinishReason, GenerationRequest
from memrad.stops import StopMatcher

log = logging.getLogger("memrad.engine")


@dataclass(frozen=True)
class FinishedState:
    """Everything a finished request leaves behind.

    `cache` holds exactly `cache_token_ids` (prompt + the generated tokens that were fed
    back); `prompt_checkpoint` is the prompt length, whose state existed before the init
    feed. `committed_text` is the prompt text plus what the client was sent.
    """

    request: GenerationRequest
    cache: Any  # transformers Cache
    cache_token_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    prompt_checkpoint: int
    committed_text: str
    completion: Completion


FinishHook = Callable[[FinishedState], None]


class Engine:
    def __init__(self, loaded: LoadedModel, prefill_chunk: int, threads: int) -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.on_finished: FinishHook | None = None

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def context_len(self) -> int:
        return self.loaded.context_len

    def init_worker_thread(self) -> None:
        """Run once on the thread that will call `generate`: fix the intra-op thread count."""
        torch.set_num_threads(self.threads)

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        return render_chat(self.loaded.tokenizer, messages, tools)

    def encode_prompt(self, text: str) -> list[int]:
        return encode_text(self.loaded.tokenizer, text)

    def decode_prompt(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return len(self.loaded.tokenizer)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.loaded.model.config)

    def generate(self, request: GenerationRequest, emit: Callable[[str], None],
                 cancelled: Callable[[], bool]) -> Completion:
        """Run `request` to completion, calling `emit` with each text delta.

        Blocking; call from the engine's single worker thread. `cancelled` is polled between
        prefill chunks and before every decode step.
        """
        started = time.perf_counter()
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        params = request.sampling
        prompt = request.prompt_ids
        checkpoint = len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.context_len - checkpoint
        assert checkpoint + max_tokens <= self.context_len, "validated before queueing"

        cache = self.new_cache()
        logits = prefill(model, cache, prompt, 0, self.prefill_chunk, cancelled)
        generated: list[int] = []
        sent: list[str] = []
        ttft_s: float | None = None
        finish: FinishReason
        if logits is None:
            finish = "cancelled"
        else:
            # The prompt checkpoint: state after prompt[:checkpoint], before the init feed.
            assert cache_length(cache) == checkpoint, "prompt checkpoint must equal the prompt length"
            generator = make_generator(params.seed)
            detok = IncrementalDetokenizer(tokenizer)
            stops = StopMatcher(params.stop)
            while True:
                token = sample(logits, params, generator)
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                if token in self.loaded.eos_ids:
                    finish = "stop"
                    break
                generated.append(token)
                text = stops.feed(detok.push(token))
                if text:
                    sent.append(text)
                    emit(text)
                if stops.stopped:
                    finish = "stop"
                    break
                if len(generated) >= max_tokens:
                    finish = "length"
                    break
                if cancelled():
                    finish = "cancelled"
                    break
                logits = decode_one_token(model, cache, token, checkpoint + len(generated) - 1)
            if finish != "cancelled":
                tail = stops.feed(detok.flush()) + stops.flush()
                if tail:
                    sent.append(tail)
                    emit(tail)

        text = "".join(sent)
        completion = Completion(
            text=text,
            finish_reason=finish,
            prompt_tokens=checkpoint,
            completion_tokens=len(generated),
            cached_tokens=0,
            ttft_s=ttft_s,
            total_s=time.perf_counter() - started,
        )
        self._hand_on(request, cache, generated, text, completion)
        return completion

    def _hand_on(self, request: GenerationRequest, cache, generated: list[int], text: str,
                 completion: Completion) -> None:
        if self.on_finished is None:
            return
        in_cache = cache_length(cache)
        fed = tuple(generated[: max(0, in_cache - len(request.prompt_ids))])
        state = FinishedState(
            request=request,
            cache=cache,
            cache_token_ids=tuple(request.prompt_ids[:in_cache]) + fed,
            generated_ids=tuple(generated),
            prompt_checkpoint=min(in_cache, len(request.prompt_ids)),
            committed_text=request.prompt_text + text,
            completion=completion,
        )
        try:
            self.on_finished(state)
        except Exception:  # a parking failure must not fail the request it came from
            log.exception("on_finished hook failed for %s", request.request_id)
