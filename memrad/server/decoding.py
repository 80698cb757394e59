"""The request fields that steer decoding, for all three APIs: sampling parameters and the
output format the reply must have. Pure: no engine, no aiohttp.

    Chat        response_format {"type": "json_object" | "json_schema", "json_schema": {"schema", "strict"}}
    Responses   text.format     {"type": "json_object" | "json_schema", "schema", "strict", "name"}
    Messages    output_config.format (and the beta's output_format) {"type": "json_schema", "schema"}

Each becomes a Constraint (memrad.chat.grammar); `reply_sampling` then picks the reply's one
grammar (a forced tool call beats an output format; `auto` tools constrain a call once it
opens) and turns one that does not compile into a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memrad.chat.grammar import TOO_SLOW, GrammarTooSlow, json_constraint
from memrad.request import Constraint, SamplingParams, TokenLogprob
from memrad.server.errors import invalid, shown

MAX_LOGIT_BIAS = 300  # entries: bounds the work one body can ask of every step
MAX_TOP_LOGPROBS = 20  # OpenAI's range for top_logprobs
RESPONSES_LOGPROBS = "message.output_text.logprobs"  # the Responses `include` entry that asks for them


def _number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    where = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not (lo < value if lo_open else lo <= value)
            or value > hi):
        raise invalid(f"{key} must be a number {where} and at most {hi:g}; got {shown(value)}", key)
    return float(value)


def top_k_of(body: dict) -> int:
    """`top_k`: 0 (or vLLM's -1) keeps every token."""
    value = body.get("top_k")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise invalid(f"top_k must be an integer of at least 0 (0 or -1: off); got {shown(value)}", "top_k")
    return max(value, 0)


def sampling_fields(body: dict) -> dict:
    """The OpenAI-shaped bodies' sampling fields beyond temperature and top_p, as
    SamplingParams keywords; out of range is a 400 naming the field."""
    fields: dict[str, Any] = {"top_k": top_k_of(body)}
    for key, lo, hi, lo_open in (("frequency_penalty", -2.0, 2.0, False), ("presence_penalty", -2.0, 2.0, False),
                                 ("repetition_penalty", 0.0, 2.0, True), ("min_p", 0.0, 1.0, False)):
        value = _number(body, key, lo, hi, lo_open=lo_open)
        if value is not None:
            fields[key] = value
    fields["logit_bias"] = logit_bias_of(body.get("logit_bias"))
    return fields


def logit_bias_of(value: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: {"token id": bias in [-100, 100]} -> sorted (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) "
                      "mapped to biases between -100 and 100", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise invalid(f"logit_bias keys must be token ids; got {shown(key)}", "logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias[{key}] must be a number between -100 and 100; got {shown(bias)}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _top_logprobs(body: dict) -> int:
    value = body.get("top_logprobs")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}; got {shown(value)}", "top_logprobs")
    return value


def chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (true: each token's) and `top_logprobs` (how many alternatives)."""
    value = body.get("logprobs")
    if value is not None and not isinstance(value, bool):
        raise invalid("logprobs must be true or false", "logprobs")
    top = _top_logprobs(body)
    return top if value else None


def responses_logprobs(body: dict) -> int | None:
    """Responses' spelling: `include: ["message.output_text.logprobs"]` and/or `top_logprobs`."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise invalid("include must be an array of strings", "include")
    top = _top_logprobs(body)
    asked = RESPONSES_LOGPROBS in (include or ()) or top > 0
    return top if asked else None


def logprob_entries(logprobs: tuple[TokenLogprob, ...]) -> list[dict]:
    """The wire form Chat's `logprobs.content` and Responses' `output_text.logprobs` share."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top]}
            for t in logprobs]


def _json_format(fmt: dict, param: str, schema: Any) -> Constraint:
    if not isinstance(schema, dict):
        raise invalid(f"{param}.schema must be a JSON schema object", f"{param}.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{param}.strict must be true or false", f"{param}.strict")
    return json_constraint(schema, f"{param}.schema")


def _output_format(value: Any, param: str, nested: str | None) -> Constraint | None:
    """An OpenAI output format: text (None), json_object, or json_schema, whose name, schema
    and strict sit in `value[nested]` (Chat) or in `value` itself (Responses)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_constraint(None, param)
    spec_shape = '{"name": ..., "schema": {...}}'
    if kind == "json_schema":
        spec, where = (value, param) if nested is None else (value.get(nested), f"{param}.{nested}")
        if not isinstance(spec, dict):
            raise invalid(f"{where} must be an object like {spec_shape}", where)
        return _json_format(spec, where, spec.get("schema"))
    json_schema = (f'{{"type": "json_schema", "{nested}": {spec_shape}}}' if nested
                   else f'{{"type": "json_schema", {spec_shape[1:-1]}}}')
    raise invalid(f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or {json_schema}', param)


def chat_response_format(value: Any) -> Constraint | None:
    """Chat's `response_format` (None: free text)."""
    return _output_format(value, "response_format", "json_schema")


def responses_text_format(value: Any) -> Constraint | None:
    """Responses' `text.format` (None: free text)."""
    return _output_format(value, "text.format", None)


def messages_output_format(body: dict) -> Constraint | None:
    """Messages' `output_config.format` (Claude Code's title query sends it), or the
    structured-outputs beta's top-level `output_format` (None: free text)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise invalid("output_config must be an object", "output_config")
    value, param = ((config or {}).get("format"), "output_config.format")
    if value is None:
        value, param = body.get("output_format"), "output_format"
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise invalid(f'{param} must be {{"type": "json_schema", "schema": {{...}}}}', param)
    return _json_format(value, param, value.get("schema"))


def reply_sampling(chat: Any, sampling: SamplingParams, tools: tuple[dict, ...] | None, mode: str,
                   name: str | None, parallel: bool) -> SamplingParams:
    """`sampling` with the reply's grammar, checked: a forced call's (tool_choice required or
    a named function), else the output format's, else, with tools in `auto`, a call's once it
    opens. A grammar that does not compile, or a bias on a token the vocabulary lacks, is a 400."""
    for token_id, _ in sampling.logit_bias:
        if token_id >= chat.vocab_size:
            raise invalid(f"logit_bias names token {token_id}, outside the vocabulary (0..{chat.vocab_size - 1})",
                          "logit_bias")
    constraint = sampling.constraint
    if tools and (mode in ("required", "function") or (mode == "auto" and constraint is None)):
        try:
            constraint = chat.tool_constraint(list(tools), mode, name, parallel) or constraint
        except GrammarTooSlow as slow:  # a tool's schema: refused, never silently any JSON object
            raise invalid(f"{slow.param} cannot be used to constrain the reply: {slow.reason}", "tools",
                          code="grammar_too_slow") from None
    if constraint is None:
        return sampling
    reason = chat.grammar_error(constraint)
    if reason is not None:
        raise invalid(f"{constraint.param} cannot be used to constrain the reply: {reason.strip()}", constraint.param,
                      code="grammar_too_slow" if reason.startswith(TOO_SLOW) else None)
    return replace(sampling, constraint=constraint)
