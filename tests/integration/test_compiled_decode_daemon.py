"""A daemon with the compiled decode step, started the way a user starts it.

`--compile on` compiles before it answers: /health says so, a resumed turn equals its cold
run, and a second start opens the compiled package from the cache instead of building it again.
`--compile auto` reports "compiling" until the step is ready and answers at once meanwhile
(eager, in exact mode too: no reply waits for a compile); `--compile wait` makes a reply wait
for the compiled step, so a first start answers a conversation byte for byte as a warm start does.
"""

from __future__ import annotations

import re

import pytest

from daemon_harness import wait_until
from test_reuse_daemon import chat, client_for
from memrad.bench.affinity_turns import SYSTEM as REWRITING_SYSTEM, TOOL_OUTPUT
from test_reuse_default_model import FIRST_USER, SYSTEM, second_turn

pytestmark = pytest.mark.integration


def compiled_in_s(daemon) -> float:
    decode = daemon.get_json("/health")["choices"]["decode"]
    assert decode["value"] == "compiled", decode
    return float(re.search(r"ready ([0-9.]+) s after the model", decode["reason"]).group(1))


def test_compiled_decode_resumes_exactly_and_a_second_start_reuses_the_compiled_code(make_daemon, tmp_path):
    daemon = make_daemon()
    daemon.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "compile")  # an empty compile cache
    daemon.env["MEMRA_COMPILE"] = "on"
    daemon.env["MEMRA_MAX_BATCH"] = "1"  # one at a time: requests decode on the compiled one-row step
    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    first_compile_s = compiled_in_s(daemon)
    client = client_for(daemon)
    first = chat(client, [SYSTEM, FIRST_USER])
    messages = second_turn(first.choices[0].message.content)
    warm = chat(client, messages)
    cold = chat(client, messages, extra_body={"cache_salt": "cold"})
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert daemon.cli("stop").returncode == 0

    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    second_compile_s = compiled_in_s(daemon)
    assert second_compile_s < 0.6 * first_compile_s, (first_compile_s, second_compile_s)
    again = chat(client_for(daemon), messages, extra_body={"cache_salt": "cold"})
    assert again.choices[0].message.content == cold.choices[0].message.content


def rewriting_conversation(client, turns: int = 8) -> list[tuple[str, tuple[float, ...], str]]:
    """An agent's conversation whose client sends every earlier reply back cut to its first
    half (a reasoning-stripping client); per turn the reply, each token's logprob (float32
    logits, so two starts that agree on every bit agree here exactly) and the decision."""
    messages, turns_seen = [{"role": "system", "content": REWRITING_SYSTEM}], []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Step {turn}. Tool result:\n{TOOL_OUTPUT}\nWhat next?"})
        answer = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=24,
                                                logprobs=True, extra_body={"session_id": "agent"})
        choice = answer.choices[0]
        turns_seen.append((choice.message.content, tuple(t.logprob for t in choice.logprobs.content),
                           answer.model_extra["memra"]["decision"]))
        messages.append({"role": "assistant", "content": choice.message.content[: len(choice.message.content) // 2]})
    return turns_seen


def first_difference(first_start, warm_start) -> str | None:
    """Where two runs of the conversation first part: the turn, the token, both decisions."""
    for turn, (a, b) in enumerate(zip(first_start, warm_start), 1):
        if a[:2] != b[:2]:
            token = next((i for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y), min(len(a[1]), len(b[1])))
            return (f"turn {turn}, token {token}: {a[0]!r} vs {b[0]!r}; logprobs {a[1][token:token + 2]} vs "
                    f"{b[1][token:token + 2]}; first start: {a[2]}; warm start: {b[2]}")
    return None


def test_a_first_start_and_a_warm_start_answer_a_rewriting_conversation_byte_identically(make_daemon, tmp_path):
    # compile = wait: the first start's replies wait for the compiled step rather than decode
    # eager, so they are what every later start answers.
    daemon = make_daemon()
    daemon.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "compile")  # an empty compile cache
    daemon.env["MEMRA_COMPILE"] = "wait"
    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    decode = daemon.get_json("/health")["choices"]["decode"]
    assert decode["value"] == "compiling" and decode["reason"].startswith(
        "compile = wait: replies wait for the compiled step"), decode
    client = client_for(daemon)
    first_reply = client.chat.completions.create(model="default", messages=[SYSTEM, FIRST_USER], temperature=0,
                                                 max_tokens=4)
    assert first_reply.choices[0].message.content
    decode = daemon.get_json("/health")["choices"]["decode"]
    assert decode["value"] == "compiled" and "package built" in decode["reason"], decode  # the reply waited
    first_start = rewriting_conversation(client)
    assert daemon.cli("stop").returncode == 0

    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    assert "from the compile cache" in daemon.get_json("/health")["choices"]["decode"]["reason"]
    warm_start = rewriting_conversation(client_for(daemon))
    # Both starts ran this checkout's code (daemon_harness): a change between them is no bits question.
    assert daemon.code_ids[0] == daemon.code_ids[1], "memrad's sources changed between the two starts"
    assert first_difference(first_start, warm_start) is None
    replies = [reply for reply, _, _ in first_start]
    assert all(replies) and len(set(replies)) > 1  # real replies, not one repeated string


def test_compile_auto_answers_while_it_compiles_in_exact_mode(make_daemon, tmp_path):
    daemon = make_daemon()
    daemon.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "compile")
    daemon.env["MEMRA_COMPILE"] = "auto"  # exact mode (the default): no reply waits for the compile
    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    decode = daemon.get_json("/health")["choices"]["decode"]
    assert decode["value"] == "compiling" and decode["reason"].startswith(
        "compile = auto: new requests decode on the eager step until the compiled step is ready"), decode
    reply = chat(client_for(daemon), [SYSTEM, FIRST_USER])  # served by the eager step meanwhile
    assert reply.choices[0].message.content
    assert "; decode: eager step" in daemon.log_text()  # the log says which step the reply ran on
    assert wait_until(lambda: daemon.get_json("/health")["choices"]["decode"]["value"] != "compiling", 300, 1.0)
    assert compiled_in_s(daemon) > 0
    assert "decode step compiled in" in daemon.log_text()


def test_a_daemon_stopped_while_compiling_ends_cleanly(make_daemon, tmp_path):
    daemon = make_daemon()
    daemon.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "compile")  # nothing to open: it compiles
    daemon.env["MEMRA_COMPILE"] = "auto"
    assert daemon.start().returncode == 0, daemon.log_text()[-2000:]
    assert daemon.get_json("/health")["choices"]["decode"]["value"] == "compiling"
    assert daemon.cli("stop").returncode == 0
    log = daemon.log_text()
    assert "stopped while compiling the decode step: the next start compiles again" in log
    assert "terminate called" not in log  # interpreter teardown under a running compile aborted
    assert not list((tmp_path / "compile").glob("decode-step-*"))  # no package half-written
