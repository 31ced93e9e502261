"""Values a method keeps for one session: reference prefills, context-free bases, hidden states.

A method object serves many sessions: ``kvcmas run`` one after another, the serving connector
interleaved (one object per namespace with the requests of many sessions in flight). Values
are keyed by ``(session, key)`` and never served to another session. The session of the hop
being built keeps all of its values; other sessions keep theirs, most recently served first,
while all values together fit in ``max_bytes``, and the rest are dropped whole (such a
session's next hop recomputes what it needs, as its first did). ``max_bytes`` 0, what
``kvcmas run`` uses, keeps only the current session's values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch


def value_bytes(value: Any) -> int:
    """Bytes of a tensor, or of anything with an ``nbytes()`` method (a SegmentKV)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(value.nbytes())


class SessionState:
    def __init__(self, max_bytes: int = 0):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, dict[Hashable, Any]] = OrderedDict()  # LRU first
        self._bytes: dict[str, int] = {}
        self._current: str | None = None
        self.dropped_sessions = 0

    def enter(self, session: str) -> None:
        """A hop of ``session`` starts: it becomes the most recent; older ones may be dropped."""
        self._current = session
        if session in self._sessions:
            self._sessions.move_to_end(session)
        self._evict()

    def get(self, session: str, key: Hashable) -> Any | None:
        values = self._sessions.get(session)
        return None if values is None else values.get(key)

    def items(self, session: str) -> list[tuple[Hashable, Any]]:
        return list(self._sessions.get(session, {}).items())

    def drop(self, session: str, key: Hashable) -> None:
        values = self._sessions.get(session, {})
        if key in values:
            self._bytes[session] -= value_bytes(values.pop(key))

    def put(self, session: str, key: Hashable, value: Any) -> None:
        if session != self._current:
            self.enter(session)
        values = self._sessions.setdefault(session, {})
        self._sessions.move_to_end(session)
        old = values.get(key)
        values[key] = value
        delta = value_bytes(value) - (0 if old is None else value_bytes(old))
        self._bytes[session] = self._bytes.get(session, 0) + delta
        self._evict()

    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def sessions(self) -> int:
        return len(self._sessions)

    def _evict(self) -> None:
        """Drop the least recently served sessions, never the current one, down to the bound."""
        total = self.nbytes()
        for session in list(self._sessions):
            if total <= self.max_bytes:
                return
            if session != self._current:
                del self._sessions[session]
                total -= self._bytes.pop(session)
                self.dropped_sessions += 1
