"""The engine's event bus: control events (memrad.protocol records) to whoever subscribed
(metrics, the control socket's bus), published on the engine thread."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("memrad.engine")


class Publisher:
    """Control events (memrad.protocol records) to the subscribed sinks, on the engine thread.

    It takes a thunk: with no sink nothing is built, since labels cost tokenizer work. A
    failing sink is logged and never breaks serving.
    """

    def __init__(self, *sinks: Callable[[object], None]) -> None:
        self._sinks = list(sinks)

    def subscribe(self, sink: Callable[[object], None]) -> None:
        self._sinks.append(sink)

    def __call__(self, make: Callable[[], object]) -> None:
        if not self._sinks:
            return
        event = make()
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # an inspector must never break serving
                log.exception("publishing %s failed", type(event).__name__)
