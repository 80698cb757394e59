"""What the inspector knows, built from protocol records alone. Pure: no Textual here."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from memrad.protocol import (
    DecisionEvent, Dropped, EvictEvent, FlightEvent, FlightInfo, ParkEvent, SessionInfo, StateSnapshot, ThreadsEvent,
    TurnEvent,
)

OUTCOMES = ("all", "resumed", "declined", "cold")


@dataclass
class InspectorState:
    """Sessions, decisions and TTFT lines; `apply` folds one record in."""

    model: str = "?"
    device: str = "?"
    flags: tuple[tuple[str, str], ...] = ()
    sessions: OrderedDict[str, SessionInfo] = field(default_factory=OrderedDict)
    decisions: list[DecisionEvent] = field(default_factory=list)
    turns: dict[str, list[TurnEvent]] = field(default_factory=dict)  # conversation -> turns
    root_of: dict[str, str] = field(default_factory=dict)           # session -> conversation
    names: dict[str, str] = field(default_factory=dict)             # conversation -> label
    dropped: int = 0
    seen_at: dict[str, float] = field(default_factory=dict)         # session -> monotonic arrival
    flights: OrderedDict[str, FlightInfo] = field(default_factory=OrderedDict)  # request -> on the model now

    def age_s(self, session: SessionInfo, now: float | None = None) -> float:
        """The session's age now: its age when reported plus the time since."""
        now = time.monotonic() if now is None else now
        return session.age_s + now - self.seen_at.get(session.session_id, now)

    def apply(self, record: object) -> None:
        if isinstance(record, StateSnapshot):
            self.model, self.device, self.flags = record.model, record.device, record.flags
            self.sessions = OrderedDict((s.session_id, s) for s in record.sessions)
            for s in record.sessions:
                self.root_of.setdefault(s.session_id, s.session_id)
                self.seen_at[s.session_id] = time.monotonic()
            self.flights = OrderedDict((f.request_id, f) for f in record.flights)
        elif isinstance(record, FlightEvent):
            flight = record.flight
            if flight.phase == "done":
                self.flights.pop(flight.request_id, None)
            else:
                self.flights[flight.request_id] = flight
        elif isinstance(record, ParkEvent):
            session = record.session
            if record.replaced is not None:
                self.sessions.pop(record.replaced, None)
            root = self.root_of.get(record.replaced, record.replaced) if record.replaced else session.session_id
            self.root_of[session.session_id] = root
            self.names[root] = session.identity or self.names.get(root, root)
            self.sessions[session.session_id] = session
            self.seen_at[session.session_id] = time.monotonic()
        elif isinstance(record, EvictEvent):
            self.sessions.pop(record.session_id, None)
        elif isinstance(record, DecisionEvent):
            self.decisions.append(record)
        elif isinstance(record, TurnEvent):
            self.flights.pop(record.request_id, None)
            key = self.root_of.get(record.conversation, record.conversation) if record.conversation else \
                f"unparked {record.request_id[-6:]}"
            self.turns.setdefault(key, []).append(record)
            self.names.setdefault(key, record.identity or key)
        elif isinstance(record, Dropped):
            self.dropped += record.count
        elif isinstance(record, ThreadsEvent):  # the header's threads flag, with the latest change's reason
            flag = f"{record.summary} ({record.render()})"
            self.flags = tuple((k, v) for k, v in self.flags if k != "threads") + (("threads", flag),)

    def decisions_for(self, outcome: str) -> list[DecisionEvent]:
        return [d for d in self.decisions if outcome == "all" or d.decision.outcome == outcome]

    def latest_decision_about(self, session_id: str | None) -> DecisionEvent | None:
        """The newest decision whose candidate was `session_id` or is now parked as it."""
        root = self.root_of.get(session_id) if session_id else None
        for event in reversed(self.decisions):
            candidate = event.decision.candidate
            if candidate == session_id or (root is not None and self.root_of.get(candidate) == root):
                return event
        return self.decisions[-1] if self.decisions else None
