"""`memrad smoke`: does reuse fire end to end, and is the resume path reproducible?

Starts a fresh daemon, plays the short scenario with a client that rewrites every earlier
reply and names its conversation, and checks that later turns resume through affinity
(the x-memra-decision header, and cached_tokens > 0). Then does the same on a second
fresh daemon and checks that every turn's output and decision are identical (both decode
with the compiled step: each start waits until `compile = auto` is done). Exit 0 only if
both hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from memrad.bench.daemons import Daemon
from memrad.bench.scenarios import REWRITES, SHORT, Scenario


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    decision: str
    text: str


def play(url: str, scenario: Scenario, rewrite: str = "half", session_id: str | None = "smoke") -> list[Turn]:
    """One client's whole conversation against `url` (greedy, so reproducible)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra = {"session_id": session_id} if session_id else {}
    messages = [{"role": "system", "content": scenario.system}]
    turns = []
    for user in scenario.user_turns:
        messages.append({"role": "user", "content": user})
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=messages, temperature=0, max_tokens=scenario.max_tokens, extra_body=extra)
        reply = raw.parse()
        text = reply.choices[0].message.content
        turns.append(Turn(reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens,
                          raw.headers.get("x-memra-decision", ""), text))
        messages.append({"role": "assistant", "content": REWRITES[rewrite](text)})
    return turns


def _run_fresh(scenario: Scenario) -> list[Turn]:
    daemon = Daemon.create()
    # Until compile = auto has compiled, a daemon decodes with the eager step, whose bits differ
    # from the compiled one's; a race between the compile and the conversation would make two
    # fresh daemons disagree (it did, once the second start opened the first's package at once).
    # Answering while compiling is tested in tests/integration/test_compiled_decode_daemon.py.
    daemon.start(settled=True)
    try:
        return play(daemon.url, scenario)
    finally:
        daemon.stop()


def smoke(scenario: Scenario = SHORT) -> int:
    first = _run_fresh(scenario)
    for i, t in enumerate(first, start=1):
        print(f"turn {i}: prompt {t.prompt_tokens} cached {t.cached_tokens}  {t.decision}")
    resumed = [t for t in first if t.decision.startswith("affinity: resumed")]
    failures = []
    if not resumed:
        failures.append("no turn resumed through affinity")
    mismatched = [i for i, t in enumerate(first, start=1) if (t.cached_tokens > 0) != ("resumed (" in t.decision)]
    if mismatched:
        failures.append(f"cached_tokens disagree with the decision on turns {mismatched}")
    second = _run_fresh(scenario)
    for i, (a, b) in enumerate(zip(first, second), start=1):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
            failures.append(f"turn {i} differs between two fresh daemons (text at character {at}; "
                            f"decisions {a.decision!r} vs {b.decision!r})")
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}")
        return 1
    print(f"smoke: ok ({len(resumed)} of {len(first)} turns resumed through affinity; "
          "two fresh daemons gave identical outputs and decisions)")
    return 0
