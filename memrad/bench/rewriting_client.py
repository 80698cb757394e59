"""A chat client that rewrites its history, against a running daemon, over HTTP.

    python -m memrad.bench.rewriting_client --url http://127.0.0.1:8765 --turns 6 [--session-id NAME]

Each turn sends the whole conversation with every earlier reply cut to its first half (a
reasoning-stripping client) and prints the decision header, cached tokens and TTFT (first
streamed text). It is the traffic behind docs/TUI.md's screenshot.
"""

from __future__ import annotations

import argparse
import time

from memrad.bench.affinity_turns import SYSTEM, TOOL_OUTPUT


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--session-id")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0)
    extra = {"session_id": args.session_id} if args.session_id else {}
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": f"Step {turn}. Tool result:\n{TOOL_OUTPUT}\nWhat next?"})
        started = time.perf_counter()
        ttft = None
        parts = []
        with client.chat.completions.with_streaming_response.create(
                model="default", messages=messages, temperature=0, max_tokens=args.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=extra) as response:
            decision = response.headers.get("x-memra-decision")
            usage = None
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - started
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        reply = "".join(parts)
        cached = usage.prompt_tokens_details.cached_tokens if usage else None
        print(f"turn {turn}: prompt {usage.prompt_tokens if usage else '?'} cached {cached} "
              f"ttft {ttft or 0:.2f}s  {decision}", flush=True)
        messages.append({"role": "assistant", "content": reply[: len(reply) // 2]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
