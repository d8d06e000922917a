"""Realtime sessions' embeddings in Redis: one Redis Stream per session, appended in order by
the session's encoder and read by its LM worker with blocking XREAD (no polling).

    key   {namespace}:rt:{session_id}         (the session id is the hash tag: one slot)
    entry first=<index of its first row>  rows=<wire-format tensor [n, hidden]>
    last  first=...  rows=... (the last rows, if any)  done=1  total=<rows in the session>

The last rows and the end ride in one entry, so a reader learns that a row is the last in the
same read that brings it (a realtime LM must not run a step past the last position).

Every append refreshes the key's TTL, so a session nobody ends (both ends died) expires
`ttl_seconds` after its last entry. An encoder that replays a session (a new one after the
first died) appends rows already there again: `first` lets the reader keep each row once.
Plain values in (URL, namespace, TTL), as the rest of connector/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis
import torch

from connector import wire
from connector.client import Mode, async_client

_SESSION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# A blocking read waits at most this long per call; the client's socket timeout is above it.
MAX_BLOCK_SECONDS = 2.0


class StreamError(RuntimeError):
    """Redis failed, or a stream holds what no encoder writes (a gap, a bad entry)."""


@dataclass
class StreamEntry:
    first: int  # the index of rows[0] in the session
    rows: torch.Tensor | None  # None on a last entry without rows
    done: bool = False
    total: int = 0  # on the last entry: rows in the session


@dataclass
class StreamBatch:
    """What one read brought: the entries after `cursor`, and the cursor after them."""

    cursor: str
    entries: list[StreamEntry]


class SessionStreams:
    """The asyncio client of the realtime session streams (encoder workers, LM workers, the
    proxy's clean-up)."""

    def __init__(
        self,
        url: str,
        namespace: str = "epd",
        ttl_seconds: int = 600,
        op_timeout: float = 5.0,
        retries: int = 3,
        mode: Mode = "standalone",
    ):
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.client = async_client(url, op_timeout, retries, mode)
        # Blocking reads hold a connection for up to MAX_BLOCK_SECONDS: their own client, so
        # appends never wait behind them, with a socket timeout past the block.
        self.reader = async_client(url, op_timeout + MAX_BLOCK_SECONDS, retries, mode)

    async def close(self) -> None:
        await self.client.aclose()
        await self.reader.aclose()

    def key(self, session_id: str) -> str:
        if not _SESSION_RE.match(session_id):
            raise ValueError(
                f"session id {session_id!r} must be 1-128 characters of [A-Za-z0-9_.-]"
            )
        return f"{self.namespace}:rt:{{{session_id}}}"

    async def append(self, session_id: str, first: int, rows: torch.Tensor) -> None:
        """Rows [n, hidden] that start at index `first` of the session."""
        await self._add(session_id, {"first": first, "rows": wire.encode(rows.cpu())})

    async def finish(self, session_id: str, first: int, rows: torch.Tensor | None) -> None:
        """The session's last entry: its last rows (from index `first`; None or empty: none)
        and the end, `first + len(rows)` rows in all."""
        fields: dict = {"first": first, "done": 1}
        if rows is not None and rows.shape[0]:
            fields["rows"] = wire.encode(rows.cpu())
            first += rows.shape[0]
        fields["total"] = first
        await self._add(session_id, fields)

    async def _add(self, session_id: str, fields: dict) -> None:
        key = self.key(session_id)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.xadd(key, fields)
            pipe.expire(key, self.ttl_seconds)
            await pipe.execute()
        except redis.RedisError as e:
            raise StreamError(f"appending to {key}: {e}") from e

    async def read(
        self, session_id: str, cursor: str = "0-0", block_seconds: float = MAX_BLOCK_SECONDS
    ) -> StreamBatch:
        """The entries after `cursor`, waiting (blocking XREAD) up to `block_seconds` for
        the first; none when nothing came."""
        key = self.key(session_id)
        block_ms = max(1, int(min(block_seconds, MAX_BLOCK_SECONDS) * 1000))
        try:
            answer = await self.reader.xread({key: cursor}, count=256, block=block_ms)
        except redis.RedisError as e:
            raise StreamError(f"reading {key}: {e}") from e
        entries: list[StreamEntry] = []
        for _, items in answer or ():
            for entry_id, fields in items:
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                entries.append(_entry(key, fields))
        return StreamBatch(cursor, entries)

    async def delete(self, session_id: str) -> int:
        try:
            return int(await self.client.delete(self.key(session_id)))
        except redis.RedisError as e:
            raise StreamError(f"deleting {self.key(session_id)}: {e}") from e

    async def exists(self, session_id: str) -> bool:
        return bool(await self.client.exists(self.key(session_id)))


def _entry(key: str, fields: dict) -> StreamEntry:
    f = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
    try:
        first = int(f["first"])
        rows = wire.decode(f["rows"]) if "rows" in f else None
        if f.get("done"):
            return StreamEntry(first, rows, done=True, total=int(f["total"]))
        if rows is None:
            raise KeyError("rows")
        return StreamEntry(first, rows)
    except (KeyError, ValueError) as e:
        raise StreamError(f"{key} holds an entry no encoder writes: {e}") from e


class RowCursor:
    """Keeps each row of a session once, in order, across replays: an entry's rows already
    taken are skipped, a gap is an error."""

    def __init__(self):
        self.count = 0
        self.total: int | None = None

    def take(self, entry: StreamEntry) -> torch.Tensor | None:
        """The entry's rows not taken yet (None: nothing new); on the last entry, `done`."""
        rows = None
        if entry.rows is not None:
            if entry.first > self.count:
                raise StreamError(f"rows {self.count}..{entry.first} of the session are missing")
            skip = self.count - entry.first
            if skip < entry.rows.shape[0]:
                rows = entry.rows[skip:]
                self.count += rows.shape[0]
        if entry.done:
            if entry.total != self.count:
                raise StreamError(
                    f"the session ended at {entry.total} rows, but {self.count} were read"
                )
            self.total = entry.total
        return rows

    @property
    def done(self) -> bool:
        return self.total is not None and self.count >= self.total


__all__ = ["RowCursor", "SessionStreams", "StreamBatch", "StreamEntry", "StreamError"]
