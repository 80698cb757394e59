"""`memrad bench draft-replay`: how many drafts a reply attempts, and keeps, replayed without a model.

At temperature 0 a speculative reply is its plain reply token for token (memrad.engine.speculation),
so which drafts a reply offers and which it keeps follows from the prompt and the plain reply
alone: a draft is kept while it equals the reply's next tokens. This replays the engine's own
drafting (`Speculating`: memrad.reuse.drafts' index and draft length) over recorded replies:

    memrad bench draft-replay --record FILE    decode the file-rewrite and fresh replies of
                                               `memrad bench speed --spec` plainly (greedy, the
                                               eager step, 400 tokens) and save their token ids
    memrad bench draft-replay FILE [--most 3]  replay them: drafts offered and kept, verify steps
                                               (and those that kept nothing), decode steps, runs

`--most 3` is a lone request on the compiled 4-row batched step, 8 the eager one-row step. Each
verify step that keeps nothing is a row (or more) computed for no token: the back-off's cost on
fresh text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def replay(prompt: list[int], reply: list[int], most: int) -> dict:
    """The engine's drafting over `reply` (its first token from the prompt's logits)."""
    from memrad.engine.speculation import Speculating

    drafting = Speculating(most, "replay")
    generated = reply[:1]
    wasted, runs = 0, {}
    while len(generated) < len(reply):
        room = min(most, len(reply) - len(generated) - 1)
        drafts = drafting.draft(tuple(prompt), generated, room)
        truth = reply[len(generated) : len(generated) + len(drafts) + 1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == truth[kept]:
            kept += 1
        generated += truth[: kept + 1]
        if drafts:
            drafting.record(len(drafts), kept, kept + 1)
            wasted += kept == 0
        else:
            drafting.plain_step()
        runs[1 + len(drafts)] = runs.get(1 + len(drafts), 0) + 1
    return {"drafted": drafting.drafted, "kept": drafting.accepted, "verify_steps": drafting.verify_steps,
            "kept_nothing": wasted, "decode_steps": drafting.decode_steps, "runs": dict(sorted(runs.items()))}


def record(path: Path, max_tokens: int) -> None:
    from memrad.bench import speculation
    from memrad.engine.engine import Engine, EngineOptions
    from memrad.engine.model.loader import load_model

    loaded = load_model("default", "cpu", "bfloat16", progress=lambda _: None, weights="int4")
    engine = Engine(loaded, EngineOptions(256, 2, compile="off", speculate="off", max_batch=1))
    engine.init_worker_thread()
    engine.decoder.start()
    engine.decoder.wait()
    out = {}
    for name, messages in (("rewrite", speculation.rewrite_messages()), ("fresh", speculation.fresh_messages())):
        request = speculation.make_request(engine, messages, name, max_tokens)
        flight = engine.admit(request, lambda _: None, lambda: False)
        while flight.completion is None and flight.error is None:
            engine.step()
        out[name] = {"prompt": list(request.prompt_ids), "reply": list(flight.out.generated)}
    path.write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench draft-replay", description=__doc__.splitlines()[0])
    parser.add_argument("replies", type=Path, help="the recorded replies (JSON: name -> prompt, reply token ids)")
    parser.add_argument("--record", action="store_true", help="decode the replies and write them to REPLIES")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--most", type=int, nargs="+", default=[3, 8], help="drafts per step at most")
    args = parser.parse_args(argv)
    if args.record:
        record(args.replies, args.max_tokens)
    for name, recorded in json.loads(args.replies.read_text()).items():
        for most in args.most:
            r = replay(recorded["prompt"], recorded["reply"], most)
            print(f"{name} ({len(recorded['reply'])} tokens), up to {most} drafted: {r['kept']} of {r['drafted']} "
                  f"drafted kept in {r['verify_steps']} verify steps ({r['kept_nothing']} kept nothing); "
                  f"{r['decode_steps']} decode steps; runs of n rows: {r['runs']}")
    return 0
