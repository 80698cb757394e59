"""`memrad bench record SCENARIO --out TRANSCRIPT`: a scripted agent session, as a real
client sends it, against a running daemon.

Each turn the client sends its whole history; earlier replies go back rewritten (`--rewrite`:
strip-think, trim, first-paragraph, half, none) and with `elide-tools` old tool results are
compacted. The transcript holds every turn's exact request body and the reply the client
got, so `bench replay` can send the very same bytes to any daemon.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memrad.bench.scenarios import HISTORY_REWRITES, REWRITES, SCENARIOS, elide_old_tool_output


def record(url: str, scenario_name: str, rewrite: str, session_id: str | None) -> dict:
    import openai

    scenario = SCENARIOS[scenario_name]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    reply_rewrite = REWRITES.get(rewrite, REWRITES["none"])
    messages: list[dict] = [{"role": "system", "content": scenario.system}]
    turns = []
    for i, user in enumerate(scenario.user_turns, start=1):
        messages.append({"role": "user", "content": user})
        if rewrite in HISTORY_REWRITES:
            messages = elide_old_tool_output(messages)
        body = {"model": "default", "messages": [dict(m) for m in messages], "temperature": 0,
                "max_tokens": scenario.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if session_id:
            body["session_id"] = session_id
        reply = client.chat.completions.create(model="default", messages=body["messages"], temperature=0,
                                               max_tokens=scenario.max_tokens,
                                               extra_body={"session_id": session_id} if session_id else None)
        text = reply.choices[0].message.content
        turns.append({"body": body, "reply": text})
        print(f"turn {i}: prompt {reply.usage.prompt_tokens} tokens", flush=True)
        messages.append({"role": "assistant", "content": reply_rewrite(text)})
    return {"scenario": scenario_name, "rewrite": rewrite, "session_id": session_id, "turns": turns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench record", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--rewrite", default="elide-tools", choices=sorted([*REWRITES, *HISTORY_REWRITES]))
    parser.add_argument("--session-id", help="name the conversation (default: unnamed, implicit affinity)")
    args = parser.parse_args(argv)
    transcript = record(args.url, args.scenario, args.rewrite, args.session_id)
    args.out.write_text(json.dumps(transcript, indent=1))
    print(f"wrote {args.out}: {len(transcript['turns'])} turns")
    return 0
