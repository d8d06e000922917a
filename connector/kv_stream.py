"""The direct KV path: blocks from a prefill worker straight to a decode worker, over one
long-lived TCP connection per pair, on plain values (addresses, bytes).

    prefill ──KVSender.send(address, values)──▶ KVReceiver ──▶ KVInbox ──take_many── decode

Frames: an 8-byte little-endian length, then one KV value (connector/kv.py: header + raw
bytes, checked by the reader like any value from Redis). A batch ends with a zero-length frame;
the receiver answers it with one byte once every value of the batch is in its inbox, so a send
that returns has landed. The inbox is bounded (oldest values dropped first: a dropped block is
a miss, recomputed or pulled from the shared tier) and hands each value out once.

NOTE: a raw socket rather than gRPC streaming: a block is one large bytes value, and gRPC's
per-message framing and copies through its own buffers cost more than a length prefix on a
socket (`epd bench pd` prints both rates).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
ACK = b"\x06"
MAX_VALUE_BYTES = 1 << 30


class KVInbox:
    """Values received for this worker, by block hash, bounded in bytes (thread-safe)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, block_hash: bytes, value: bytes) -> None:
        with self._lock:
            old = self._values.pop(block_hash, None)
            if old is not None:
                self.nbytes -= len(old)
            self._values[block_hash] = value
            self.nbytes += len(value)
            while self.nbytes > self.max_bytes and self._values:
                _, dropped = self._values.popitem(last=False)
                self.nbytes -= len(dropped)

    def take_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """The values of `hashes` (None: not here), removed from the inbox."""
        with self._lock:
            out = []
            for h in hashes:
                value = self._values.pop(h, None)
                if value is not None:
                    self.nbytes -= len(value)
                out.append(value)
            return out

    def __len__(self) -> int:
        return len(self._values)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


class KVReceiver:
    """A TCP listener that files every value it receives in `inbox` (a thread per peer)."""

    def __init__(self, host: str, port: int, inbox: KVInbox, hash_of):
        self.inbox = inbox
        self.hash_of = hash_of  # value -> its block hash (read from the header)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.bytes_received = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="kv-receiver", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                    if n == 0:
                        conn.sendall(ACK)
                        continue
                    if n > MAX_VALUE_BYTES:
                        raise ConnectionError(f"a {n}-byte frame is over the limit")
                    value = _recv_exact(conn, n)
                    self.bytes_received += n
                    try:
                        self.inbox.put(self.hash_of(value), value)
                    except ValueError as e:  # no readable header: dropped, a miss later
                        logger.warning("dropping an unreadable KV value: %s", e)
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self._stopping = True
        # shutdown first: a close alone leaves the accept() under way listening.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


class KVSender:
    """One connection per peer address, opened on first use and kept (thread-safe per peer)."""

    def __init__(self, timeout: float = 10.0):
        self.timeout = timeout
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def send(self, address: str, values: Sequence[bytes]) -> int:
        """Send a batch and wait for its acknowledgement; the bytes sent. A broken connection
        is reopened once; OSError / ConnectionError when the peer cannot be reached."""
        with self._lock:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            for attempt in (0, 1):
                sock = self._conns.get(address)
                try:
                    if sock is None:
                        sock = self._connect(address)
                    for value in values:
                        sock.sendall(_LEN.pack(len(value)))
                        sock.sendall(value)
                    sock.sendall(_LEN.pack(0))
                    if _recv_exact(sock, 1) != ACK:
                        raise ConnectionError("bad acknowledgement")
                    return sum(len(v) for v in values)
                except (OSError, ConnectionError):
                    self._drop(address)
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)


__all__ = ["KVInbox", "KVReceiver", "KVSender"]
