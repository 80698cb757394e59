"""The default model at its native quality where the conversation fits (issue 32, item 3).

memrad serves the default model (native 8,192) at 32,768 under YaRN x4, which interpolates
every position, short prompts included. Per conversation, a request whose prompt + max_tokens
fits 8,192 runs at the native rope: five short factual questions at default settings get,
token for token and logprob for logprob, the greedy answers of `--context 8192` (never
scaled). A conversation that grows past 8,192 is re-prefilled under yarn once, the reason in
its decision, and its next turn resumes the rescaled state. (The crossing here is the reply
budget's: a 4k-token prompt with an agent's 4,096 reply tokens, so the story primes 8k tokens,
not 16k.)
"""

from __future__ import annotations

import re

import pytest

QUESTIONS = ("What is the capital of France?", "What is the largest planet in the solar system?",
             "How many days are in a week?", "What is the chemical symbol for gold?", "Who wrote Romeo and Juliet?")
SYSTEM = "You are a coding agent. The repository:\n" + "\n".join(
    f"src/module_{i:03d}.py: defines helper_{i}(x) and class Widget{i}; see tests/test_{i:03d}.py"
    for i in range(106))  # ~4k tokens
REPLY = 4096  # what an agent's 32,000 is lowered to (limits.max_reply_tokens)


@pytest.fixture(scope="module")
def daemons(make_daemon):
    """(the default daemon, one started with --context 8192), both decoding on the eager step:
    the compiled step's bits are not the eager step's, and the 8,192 daemon's package (another
    capacity) may still be building when the other's is open."""
    started = []
    for context in (None, "8192"):
        d = make_daemon()
        d.env["MEMRA_COMPILE"] = "off"
        if context is not None:
            d.env["MEMRA_CONTEXT"] = context
        result = d.start()
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{d.log_text()[-3000:]}"
        started.append(d)
    return started


def chat(daemon, messages, max_tokens, **extra):
    status, body = daemon.post("/v1/chat/completions", {"model": "default", "messages": messages, "temperature": 0,
                                                        "max_tokens": max_tokens, **extra}, timeout=600)
    assert status == 200, body
    return body


def test_short_questions_get_the_native_models_greedy_answers(daemons):
    scaled, native = daemons
    models = [d.get_json("/v1/models")["data"][0] for d in daemons]
    assert [(m["context_length"], m["native_context_length"], m["context_scaling"]) for m in models] == [
        (32768, 8192, "yarn x4"), (8192, 8192, "native")]
    assert models[0]["context_rule"].startswith("32,768 tokens served: a request whose prompt + max_tokens fits "
                                                "the native 8,192 runs at the model's native RoPE")
    assert scaled.status()["choices"]["context"]["value"] == "native to 8,192, yarn x4 to 32,768"
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ours, theirs = (chat(d, messages, 24, logprobs=True) for d in (scaled, native))
        assert ours["memra"]["rope"] == "native" and theirs["memra"]["rope"] == "native"
        got, want = (body["choices"][0]["logprobs"]["content"] for body in (ours, theirs))
        assert [(t["bytes"], t["logprob"]) for t in got] == [(t["bytes"], t["logprob"]) for t in want], question
        if "France" in question:
            assert "Paris" in ours["choices"][0]["message"]["content"], ours["choices"][0]["message"]["content"]


def fitted_question(daemon, target):
    """A first user turn whose rendered prompt (beside SYSTEM) is `target` tokens or a few fewer."""
    pad = 0
    for _ in range(6):
        question = "Which module defines helper_7?" + " ok" * pad
        status, body = daemon.post("/v1/messages/count_tokens", {"model": "default", "system": SYSTEM, "messages": [
            {"role": "user", "content": question}]})
        assert status == 200, body
        if target - 8 <= body["input_tokens"] <= target:
            return question, body["input_tokens"]
        pad = max(pad + target - 4 - body["input_tokens"], 0)
    raise AssertionError(f"no padding reached {target} tokens")


def test_a_conversation_that_crosses_the_native_length_is_rescaled_once(daemons):
    """An agent's turns (the same max_tokens each: 4,096, the reply cap): the first fits the
    native 8,192 with its reply budget, the second does not (rescaled, cold once), the third
    resumes the rescaled state. Replies stop at their first line."""
    scaled, _ = daemons
    question, p1 = fitted_question(scaled, 8192 - REPLY)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ask = dict(user="rope-story", stop=["\n", "."])
    first = chat(scaled, messages, REPLY, **ask)
    assert first["usage"]["prompt_tokens"] == p1 and first["memra"]["rope"] == "native", first["usage"]
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And which test covers it? Name the file."}]
    second = chat(scaled, messages, REPLY, **ask)
    p2 = second["usage"]["prompt_tokens"]
    assert second["memra"]["rope"] == "yarn x4" and second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    found = re.search(r"declined \(rescaled: ([\d,]+) tokens \(prompt ([\d,]+) \+ reply 4,096\) > native 8,192; "
                      r"(s\d+) was primed under the native rope, ([\d,]+) tokens not reused\)", second["memra"]["decision"])
    assert found, second["memra"]["decision"]
    assert [int(found[i].replace(",", "")) for i in (1, 2, 4)] == [p2 + REPLY, p2, p1]
    messages += [{"role": "assistant", "content": second["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Thanks."}]
    third = chat(scaled, messages, REPLY, **ask)
    assert third["memra"]["rope"] == "yarn x4" and " resumed (" in third["memra"]["decision"], third["memra"]
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= p2 - 256
