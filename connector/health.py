"""The embedding store's health as one process sees it: answering, or not answering since when.

    operation ──check──▶ StoreHealth ──not answering──▶ StoreUnavailable at once (no round trip)
    operation ──no answer within the deadline──▶ failed ──▶ not answering (since the streak began)
    probe (PING, by the asyncio connector) ──answer──▶ answered ──▶ answering

A store is "not answering" once it has gone `deadline` seconds without answering anything (a
streak of failed operations, counted from the start of the first): a Redis restarted within
the deadline is ridden out by the operations' retries and never marks it. Every method runs on
the event loop of the connector that owns it.
"""

from __future__ import annotations

import time
from typing import Any

from connector.ec import ConnectorError


class StoreUnavailable(ConnectorError):
    """The embedding store did not answer within the request-path deadline, or is known not to
    be answering: the requests that need it fail (UNAVAILABLE / HTTP 503) instead of waiting."""

    def __init__(self, message: str):
        super().__init__(message, "timeout")


class StoreHealth:
    """Answering, or not answering since when, with the last error; `deadline`: how long the
    store may go without answering before it is marked."""

    def __init__(self, url: str, deadline: float):
        self.url = url  # redacted
        self.deadline = deadline
        self.answering = True
        self.since = time.time()  # wall clock: when the current state began
        self.error = ""
        self._streak: float | None = None  # monotonic start of the failures since an answer

    def check(self, op: str) -> None:
        """Raise StoreUnavailable when the store is known not to be answering."""
        if not self.answering:
            raise StoreUnavailable(self.message(op))

    def failed(self, started: float, error: str) -> bool:
        """An operation begun at `started` (monotonic) got no answer. True: this marks the store
        not answering (the caller starts probing it)."""
        now = time.monotonic()
        if self._streak is None or started < self._streak:
            self._streak = started
        self.error = error
        if self.answering and now - self._streak >= self.deadline:
            self.answering = False
            self.since = time.time() - (now - self._streak)
            return True
        return False

    def answered(self) -> None:
        """The store answered (a reply, even an error reply)."""
        self._streak = None
        if not self.answering:
            self.answering = True
            self.since = time.time()
            self.error = ""

    def message(self, op: str = "") -> str:
        """What a request that needed the store is told (`op`: the operation it needed)."""
        prefix = f"{op}: " if op else ""
        if self.answering:
            return (
                f"{prefix}the embedding store (Redis at {self.url}) did not answer within "
                f"{self.deadline:g}s: {self.error}"
            )
        return (
            f"{prefix}the embedding store (Redis at {self.url}) is not answering (for "
            f"{time.time() - self.since:.1f}s): {self.error}"
        )

    def state(self) -> dict[str, Any]:
        """For the dashboard: {"answering", "since" (unix seconds), "error", "deadline_seconds"}."""
        return {
            "answering": self.answering,
            "since": round(self.since, 1),
            "error": self.error,
            "deadline_seconds": self.deadline,
        }
