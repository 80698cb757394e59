"""Recent Responses-API responses, so `previous_response_id` resolves. Bounded, in memory.

A follow-up that names a previous response gets that response's whole conversation (its
input history plus its reply) and the identity it ran under, so affinity nominates the
session that response parked by name. Responses are dropped oldest first past the cap and
are all gone after a restart: an unknown id is a 400 that says so (responses_api).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from memrad.request import Identity

MAX_RESPONSES = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    messages: tuple[dict, ...]  # internal messages: the input history, then the reply
    identity: Identity | None


class ResponseStore:
    """Least recently stored first out; `get` does not refresh (mutates on `put` only)."""

    def __init__(self, max_responses: int = MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, record: StoredResponse) -> None:
        self._records[record.response_id] = record
        while len(self._records) > self.max_responses:
            self._records.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._records.get(response_id)

    def __len__(self) -> int:
        return len(self._records)
