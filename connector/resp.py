"""Bulk replies received straight into buffers of their own: GET / MGET of large values with one
copy (the kernel's) instead of three.

redis-py reads a reply in chunks into its read buffer, hands them to its parser (hiredis keeps
its own copy) and builds a bytes object from that (one more copy): for a 0.25 MiB embedding
those copies cost about as much as the round trip. Here each bulk string of the reply is
received (`recv_into`) into a buffer allocated at the length the reply announces, and given
back as a writable memoryview over it; a tensor decoded from it views that memory.

Only the reply shapes of GET and MGET are read: a bulk string, a nil, an array of those, or an
error line (raised as redis-py raises it). The command goes out on a connection of the
client's own pool, with the client's retries: a connection error or a timeout drops the
connection (its stream position is unknown) and the retry reconnects. A protocol surprise
drops the connection too, never leaving it half read.
"""

from __future__ import annotations

import socket

import numpy as np
import redis
from redis.exceptions import InvalidResponse

# Bytes asked of the socket while looking for a reply's line end: a line is short ("$262208",
# "*2"); what comes after it in the same read is copied into the value's buffer.
_LINE_READ = 256


class _Reader:
    """One reply's bytes: lines, then bulk payloads received into their own buffers."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.pending = b""  # received past what was consumed

    def _recv(self) -> bytes:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise redis.ConnectionError("connection closed by the server mid-reply")
        return chunk

    def line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self.pending += self._recv()
        line, self.pending = self.pending[:end], self.pending[end + 2 :]
        return line

    def into(self, view: memoryview) -> None:
        """Fill `view` from the stream (what is pending first, then straight from the socket)."""
        have = min(len(self.pending), len(view))
        if have:
            view[:have] = self.pending[:have]
            self.pending = self.pending[have:]
        size = len(view)
        while have < size:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("connection closed by the server mid-reply")
            have += got

    def bulk(self, line: bytes) -> memoryview | None:
        """The bulk string that `line` announces: its bytes in a fresh buffer, or None (nil)."""
        if line[:1] == b"_" or line == b"$-1":  # RESP3 / RESP2 nil
            return None
        if line[:1] != b"$":
            raise InvalidResponse(f"expected a bulk string, got {line[:32]!r}")
        size = int(line[1:])
        buffer = np.empty(size + 2, dtype=np.uint8)
        view = memoryview(buffer)
        self.into(view)
        if view[size:] != b"\r\n":
            raise InvalidResponse("bulk string not terminated by CRLF")
        return view[:size]


def _exchange(conn: redis.Connection, args: tuple[str, ...]) -> list[memoryview | None]:
    conn.send_command(*args)  # connects (and checks health) first where needed
    reader = _Reader(conn._sock)
    try:
        first = reader.line()
        if first[:1] == b"-":  # the whole command failed; the line is consumed
            error = first[1:].decode(errors="replace")
            raise conn._parser.parse_error(error)
        if first[:1] == b"*":
            values = [reader.bulk(reader.line()) for _ in range(int(first[1:]))]
        else:
            values = [reader.bulk(first)]
        if reader.pending:
            raise InvalidResponse(f"{len(reader.pending)} bytes past the end of the reply")
        return values
    except redis.ResponseError:
        raise
    except TimeoutError as e:  # socket.timeout
        conn.disconnect()
        raise redis.TimeoutError(f"timeout reading from {_where(conn)}") from e
    except OSError as e:
        conn.disconnect()
        raise redis.ConnectionError(f"error reading from {_where(conn)}: {e}") from e
    except BaseException:
        conn.disconnect()
        raise


def _where(conn: redis.Connection) -> str:
    host = getattr(conn, "host", None)
    return f"{host}:{conn.port}" if host else str(getattr(conn, "path", "redis"))


def fetch_bulk(client: redis.Redis, *args: str) -> list[memoryview | None]:
    """Run `args` (GET key, or MGET keys...) and return its values: memoryviews over buffers
    of their own (writable; None for a missing key), in reply order. Raises redis-py's errors
    (ResponseError for an error reply; ConnectionError / TimeoutError once retries are
    spent)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        return conn.retry.call_with_retry(
            lambda: _exchange(conn, args), lambda _error: conn.disconnect()
        )
    finally:
        pool.release(conn)
