"""The LM worker's side of realtime sessions: each session's stream of per-position
embeddings (connector/streams.py), read with blocking XREAD as the encoder publishes it and
handed to the engine (`append_realtime`) into the request's inputs (lm_worker/inputs.py),
whose `ready_tokens` lets the request step once the embedding of its next position is in. The
request stays resident (its KV blocks held) while it waits; other requests keep stepping.

A session's reader lives as long as its Generate call. When the call ends (the request
finished, the client cancelled, the proxy went away) the reader stops; the session's rows end
with its request in the engine; the stream itself is the proxy's to delete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from connector.streams import RowCursor, SessionStreams, StreamError
from lm_worker.engine import LMEngine

logger = logging.getLogger(__name__)


class TooManySessions(RuntimeError):
    """The worker runs `max_sessions` realtime sessions already (RESOURCE_EXHAUSTED)."""


class SessionRunning(ValueError):
    """The realtime session runs on this worker already (ALREADY_EXISTS)."""


class RealtimeFeeder:
    def __init__(self, streams: SessionStreams, engine: LMEngine, max_sessions: int):
        self.streams = streams
        self.engine = engine
        self.max_sessions = max_sessions
        self.sessions: set[str] = set()  # reserved: their requests are here
        self.readers: dict[str, asyncio.Task] = {}

    @property
    def open(self) -> int:
        return len(self.sessions)

    def reserve(self, session_id: str) -> None:
        """Count the session in before its request enters the engine; TooManySessions when
        the worker is full, SessionRunning when the session already runs here."""
        if session_id in self.sessions:
            raise SessionRunning(f"realtime session {session_id} already runs on this worker")
        if len(self.sessions) >= self.max_sessions:
            raise TooManySessions(
                f"this LM worker runs {len(self.sessions)} realtime sessions "
                "(lm.max_realtime_sessions)"
            )
        self.sessions.add(session_id)
        self.engine.metrics.realtime_sessions.set(len(self.sessions))

    def start(self, session_id: str, on_error: Callable[[str], None]) -> None:
        """Read the session's stream into the engine until its last entry."""
        self.readers[session_id] = asyncio.create_task(
            self._read(session_id, on_error), name=f"realtime-{session_id}"
        )

    def stop(self, session_id: str) -> None:
        """End the session here: its reader (its rows in the engine end with its request).
        The stream's key stays: the proxy owns the session and deletes it at the end (another
        LM worker may take the session over from it meanwhile); its TTL covers a proxy that
        died."""
        self.sessions.discard(session_id)
        self.engine.metrics.realtime_sessions.set(len(self.sessions))
        task = self.readers.pop(session_id, None)
        if task is not None:
            task.cancel()  # at its next await: it appends nothing after this

    async def _read(self, session_id: str, on_error: Callable[[str], None]) -> None:
        cursor = "0-0"
        rows_cursor = RowCursor()
        engine = self.engine
        try:
            while not rows_cursor.done:
                batch = await self.streams.read(session_id, cursor)
                cursor = batch.cursor
                taken = [r for r in map(rows_cursor.take, batch.entries) if r is not None]
                if taken or rows_cursor.done:
                    rows = torch.cat(taken) if taken else torch.zeros(0)
                    engine.metrics.realtime_rows.inc(rows.shape[0])
                    engine.append_realtime(session_id, rows, closed=rows_cursor.done)
        except StreamError as e:
            logger.warning("session %s: %s", session_id, e)
            on_error(str(e))


__all__ = ["RealtimeFeeder", "SessionRunning", "TooManySessions"]
