"""A prefill chunk that stops between decoder layers once its request is cancelled.

A request's cancel used to land between chunks only: on a busy machine one 256-token chunk
took 9 s, and a client that hung up and retried at once found nothing parked and primed the
whole prompt a second time. Checked before every decoder layer, the cancel lands within one
layer's time (a thirtieth of a chunk on the default model):

    chunk [a, b)   layer 0 .. k-1 ran: their KV rows a..b written | layer k: cancelled
                   -> every layer rewound to a: the cache holds exactly prompt[:a], the last
                      cut the chunks reached, which the engine parks (grid-aligned, exact)

Only for caches whose every layer can be cut back (plain attention): recurrent and sliding
window layers update in place and cannot be rewound, so there the cancel waits for the chunk's
end, as before. The hooks are on the layers only while a chunk runs: nothing else that calls
the model (a compiled or traced step) ever sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Interrupted(Exception):
    """Raised inside the model's forward: the chunk's request was cancelled."""


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers (transformers' `model.model.layers`), or [] where it has none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


@contextmanager
def between_layers(model: Any, cancelled: Callable[[], bool]) -> Iterator[None]:
    """Within the block, a forward of `model` raises Interrupted before the first decoder
    layer that starts after `cancelled()` turned true."""

    def check(module: Any, args: Any) -> None:
        if cancelled():
            raise Interrupted()

    handles = [layer.register_forward_pre_hook(check) for layer in decoder_layers(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def rewind_layers(cache: Any, length: int) -> None:
    """Cut every layer of a croppable cache back to `length` tokens: after an interrupted
    chunk the layers that ran hold more rows than the ones that did not."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length if getattr(layer, "is_initialized", False) else 0
        if extra > 0:
            layer.crop(-extra)
