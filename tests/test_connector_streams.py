"""connector/streams.py on a real (embedded) valkey: a session's rows in order through a
Redis Stream with a TTL, read by blocking XREAD, replays deduplicated, keys deleted."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from connector.streams import RowCursor, SessionStreams, StreamEntry, StreamError


async def test_rows_in_order_with_ttl_and_delete(redis_server):
    streams = SessionStreams(redis_server.url, namespace="t", ttl_seconds=30)
    try:
        rows = torch.randn(5, 8)
        await streams.append("s-1", 0, rows[:2])
        await streams.append("s-1", 2, rows[2:4])
        await streams.finish("s-1", 4, rows[4:])  # the last row and the end together
        ttl = await streams.client.ttl(streams.key("s-1"))
        assert 0 < ttl <= 30
        batch = await streams.read("s-1")
        assert [e.done for e in batch.entries] == [False, False, True]
        cursor = RowCursor()
        got = [r for r in (cursor.take(e) for e in batch.entries) if r is not None]
        assert torch.equal(torch.cat(got), rows)
        assert cursor.done
        assert await streams.delete("s-1") == 1
        assert not await streams.exists("s-1")
    finally:
        await streams.close()


async def test_a_blocking_read_wakes_on_append(redis_server):
    streams = SessionStreams(redis_server.url, namespace="t")
    try:
        started = time.monotonic()
        read = asyncio.ensure_future(streams.read("s-2", block_seconds=2.0))
        await asyncio.sleep(0.2)
        assert not read.done()  # waiting in XREAD, not returning empty
        await streams.append("s-2", 0, torch.ones(1, 4))
        batch = await read
        assert len(batch.entries) == 1 and batch.entries[0].first == 0
        assert time.monotonic() - started < 1.5
        # Nothing after the cursor: the next read waits out its block and comes back empty.
        empty = await streams.read("s-2", batch.cursor, block_seconds=0.1)
        assert empty.entries == [] and empty.cursor == batch.cursor
        await streams.delete("s-2")
    finally:
        await streams.close()


def test_a_replay_keeps_each_row_once_and_a_gap_is_an_error():
    rows = torch.arange(12.0).reshape(6, 2)
    cursor = RowCursor()
    assert torch.equal(cursor.take(StreamEntry(0, rows[:3])), rows[:3])
    # A new encoder replays from the start: rows 0..3 again, then new ones.
    assert cursor.take(StreamEntry(0, rows[:2])) is None
    assert torch.equal(cursor.take(StreamEntry(2, rows[2:5])), rows[3:5])
    assert not cursor.done
    assert torch.equal(cursor.take(StreamEntry(5, rows[5:], done=True, total=6)), rows[5:])
    assert cursor.done and cursor.count == 6
    with pytest.raises(StreamError, match="missing"):
        RowCursor().take(StreamEntry(2, rows[2:3]))
    short = RowCursor()
    short.take(StreamEntry(0, rows[:5]))
    with pytest.raises(StreamError, match="ended at 6 rows, but 5"):
        short.take(StreamEntry(6, None, done=True, total=6))


def test_session_ids_are_checked(redis_server):
    streams = SessionStreams(redis_server.url)
    with pytest.raises(ValueError, match="session id"):
        streams.key("a b")
    asyncio.run(streams.close())
