"""memrad.server.overflow.fit: the reply's token budget from the room the prompt leaves and the
server's reply cap (limits.max_reply_tokens), with a note only where a client's ask was cut."""

from __future__ import annotations

import pytest

from memrad.server.chat_api import parse_chat
from memrad.server.errors import APIError
from memrad.server.overflow import fit

USER = [{"role": "user", "content": "hi"}]


def fitted(max_tokens, num_prompt=100, context_len=1000, cap=None):
    body = {"messages": USER} if max_tokens is None else {"messages": USER, "max_tokens": max_tokens}
    parsed = fit(parse_chat(body, None), num_prompt, context_len, "openai", "messages", cap)
    return parsed.sampling.max_tokens, parsed.notes


@pytest.mark.parametrize("max_tokens, cap, expected", [
    (None, None, (None, ())),  # the API's default: the rest of the context, left to the engine
    (None, 300, (300, ())),  # the server's bound is the default: nothing was asked, nothing is said
    (None, 5000, (None, ())),  # a cap past the room changes nothing
    (200, 300, (200, ())),
    (300, 300, (300, ())),
    (301, 300, (300, ("max_tokens 301 lowered to 300: this server's reply cap (limits.max_reply_tokens)",))),
    (950, None, (900, ("max_tokens 950 lowered to 900: the prompt's 100 tokens leave 900 of this model's 1000",))),
    # The room is the tighter bound: the context is what the client must hear of.
    (950, 5000, (900, ("max_tokens 950 lowered to 900: the prompt's 100 tokens leave 900 of this model's 1000",))),
])
def test_max_tokens_is_bounded_by_the_room_and_the_cap(max_tokens, cap, expected):
    assert fitted(max_tokens, cap=cap) == expected


def test_a_prompt_that_fills_the_context_is_refused_whatever_the_cap():
    with pytest.raises(APIError) as refused:
        fitted(10, num_prompt=1000, cap=300)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
