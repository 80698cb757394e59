"""Context overflow, answered the way each API's clients recover from it. Pure.

    prompt + max_tokens fits          -> as asked
    the prompt fits, the reply not    -> max_tokens lowered to the room left (a note in the
                                         `memra` field); the reply may end with `length`
    max_tokens past the reply cap     -> lowered to `limits.max_reply_tokens` (a note too),
    (or not given)                       as llama-server's `--n-predict` caps every slot
    the prompt alone does not fit     -> 400: Chat and Responses `context_length_exceeded`
                                         naming the prompt (`messages` / `input`), which
                                         Codex, Qwen Code and opencode act on; Messages the
                                         words Anthropic uses ("prompt is too long: N tokens
                                         > M maximum"), which Claude Code parses

Agent clients ask for more than a small local model holds (Claude Code and opencode
max_tokens 32000, Qwen Code 8000): refusing them made opencode compact and retry forever.
At 32k a small model fills that room rambling (the 135M default model wrote 25k tokens for
over ten minutes), past Claude Code's 300 s request timeout, which re-sends the request: the
reply cap keeps one reply to what a person waits for.
"""

from __future__ import annotations

from dataclasses import replace

from memrad.server.errors import APIError, ErrorStyle, invalid
from memrad.server.validate import ParsedRequest


def prompt_too_long(num_prompt: int, context_len: int, style: ErrorStyle, param: str) -> APIError:
    """The 400 for a prompt that leaves no room for one generated token."""
    if style == "anthropic":
        return invalid(f"prompt is too long: {num_prompt} tokens > {context_len - 1} maximum")
    return invalid(f"This model's maximum context length is {context_len} tokens. However, your messages resulted "
                   f"in {num_prompt} tokens, leaving no room for a reply. Shorten or compact the conversation.",
                   param, code="context_length_exceeded")


def fit(parsed: ParsedRequest, num_prompt: int, context_len: int, style: ErrorStyle, param: str,
        reply_cap: int | None = None) -> ParsedRequest:
    """The request with max_tokens within the room the prompt leaves and within `reply_cap`
    (None: no cap), or the API's 400. `param` names the prompt's field (messages, input, prompt)."""
    if num_prompt == 0:
        raise invalid("the prompt is empty after tokenization", param)
    room = context_len - num_prompt
    if room < 1:
        raise prompt_too_long(num_prompt, context_len, style, param)
    asked = parsed.sampling.max_tokens
    bound = room if reply_cap is None else min(room, reply_cap)
    if asked is None:  # the API's default, "the rest of the context", is the server's bound: no note
        return replace(parsed, sampling=replace(parsed.sampling, max_tokens=bound)) if bound < room else parsed
    if asked <= bound:
        return parsed
    if bound < room:
        note = f"max_tokens {asked} lowered to {bound}: this server's reply cap (limits.max_reply_tokens)"
    else:
        note = (f"max_tokens {asked} lowered to {room}: the prompt's {num_prompt} tokens leave {room} of this "
                f"model's {context_len}")
    return replace(parsed, sampling=replace(parsed.sampling, max_tokens=bound), notes=parsed.notes + (note,))
