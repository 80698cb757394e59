"""Turning a request into prompt text and token ids with the model's own tokenizer."""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """The request cannot be rendered with this model's tokenizer; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """Render with the chat template (generation prompt appended); return (text, ids).

    The text is tokenized with add_special_tokens=False: the template already wrote every
    control token it wants, and adding a BOS twice would shift every position.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "this model has no chat template; send a raw prompt to /v1/completions instead",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja raise_exception() and template errors
        raise PromptError(f"the model's chat template rejected these messages: {exc}", "messages") from exc
    return text, encode_text(tokenizer, text, add_special_tokens=False)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer)
