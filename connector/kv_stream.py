"""The direct KV path: blocks from a prefill worker straight to a decode worker, over one
long-lived TCP connection per pair, on plain values (addresses, bytes).

    prefill ──KVSender.send_frames(…), finish──▶ KVReceiver ──▶ KVInbox ──take_many── decode

Frames: an 8-byte little-endian length, then one KV value (connector/kv.py: header + raw
bytes, checked by the reader like any value from Redis). A value holds a whole block or one
layer range of it (its header says which): a prefill worker sends each layer of a step's
blocks as that layer is computed (`send_frames`, no wait), and ends the step with `finish`. A
batch ends with a zero-length frame; the receiver answers it with one byte once every value
before it is in its inbox, so a batch that is acknowledged has landed. The inbox is bounded
(oldest blocks dropped first: a dropped block is a miss, recomputed or pulled from the shared
tier) and hands a block out once, and only once all its layers are in.

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
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
ACK = b"\x06"
MAX_VALUE_BYTES = 1 << 30

# One frame's value, whole (bytes) or in parts written back to back (header, payload view).
Frame = bytes | Sequence[bytes | memoryview]


class KVInbox:
    """Values received for this worker, by block hash and first layer, bounded in bytes
    (thread-safe). A block may arrive as one value or as several layer ranges."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.incomplete = 0  # blocks taken with a layer missing (handed out as misses)
        # block hash -> first layer -> (number of layers, value)
        self._blocks: OrderedDict[bytes, dict[int, tuple[int, bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, block_hash: bytes, value: bytes, first_layer: int = 0, num_layers: int = 0):
        """File a value (a layer range of the block; `num_layers` 0: the whole block)."""
        with self._lock:
            pieces = self._blocks.get(block_hash)
            if pieces is None:
                pieces = self._blocks[block_hash] = {}
            old = pieces.pop(first_layer, None)
            if old is not None:
                self.nbytes -= len(old[1])
            pieces[first_layer] = (num_layers, value)
            self.nbytes += len(value)
            while self.nbytes > self.max_bytes and self._blocks:
                _, dropped = self._blocks.popitem(last=False)
                self.nbytes -= sum(len(v) for _, v in dropped.values())

    def take_many(self, hashes: Sequence[bytes], num_layers: int) -> list[list[bytes] | None]:
        """Each block's values in layer order when they cover layers 0 .. num_layers - 1 with
        no gap (None: not here, or a layer missing), removed from the inbox either way."""
        with self._lock:
            out = []
            for h in hashes:
                pieces = self._blocks.pop(h, None)
                if pieces is None:
                    out.append(None)
                    continue
                self.nbytes -= sum(len(v) for _, v in pieces.values())
                values, covered = [], 0
                for first in sorted(pieces):
                    n, value = pieces[first]
                    if first != covered:
                        break
                    values.append(value)
                    covered = first + (n or num_layers)
                if covered == num_layers:
                    out.append(values)
                else:
                    self.incomplete += 1
                    out.append(None)
            return out

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_values(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._blocks.values())


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

    def __init__(
        self,
        host: str,
        port: int,
        inbox: KVInbox,
        key_of: Callable[[bytes], tuple[bytes, int, int]],
    ):
        self.inbox = inbox
        # value -> (block hash, first layer, number of layers), read from its header
        self.key_of = key_of
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.bytes_received = 0
        self._stopping = False
        self._conns: set[socket.socket] = set()  # open peer connections, closed on close()
        self._conns_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="kv-receiver", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
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
                        self.inbox.put(*_filed(self.key_of(value), value))
                    except ValueError as e:  # no readable header: dropped, a miss later
                        logger.warning("dropping an unreadable KV value: %s", e)
            except (ConnectionError, OSError):
                return
            finally:
                with self._conns_lock:
                    self._conns.discard(conn)

    def close(self) -> None:
        """Stop listening and drop every peer connection (their senders see it fail)."""
        with self._conns_lock:
            self._stopping = True
            conns = list(self._conns)
        # shutdown first: a close alone leaves the accept() under way listening.
        for sock in (self.sock, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


class KVSender:
    """One connection per peer address, opened on first use and kept (thread-safe per peer).

    `send` writes a batch and waits for its acknowledgement. `send_frames` and `finish` split
    that: frames go out as they are ready (one layer of a step's blocks at a time) and
    `finish` waits for the acknowledgement of all of them; each connection has an epoch, so a
    batch whose connection was replaced midway (frames possibly lost) fails its `finish`
    instead of being acknowledged by the new one."""

    def __init__(self, timeout: float = 10.0):
        self.timeout = timeout
        self._conns: dict[str, tuple[socket.socket, int]] = {}
        self._epoch = 0
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def send(self, address: str, values: Sequence[Frame]) -> int:
        """Send a batch and wait for its acknowledgement; the bytes sent. A broken connection
        is reopened once; OSError / ConnectionError when the peer cannot be reached."""
        with self._peer(address):
            for attempt in (0, 1):
                try:
                    sock, _ = self._conn(address)
                    nbytes = _write_frames(sock, values)
                    _finish(sock)
                    return nbytes
                except (OSError, ConnectionError):
                    self._drop(address)
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def send_frames(self, address: str, frames: Sequence[Frame], epoch: int | None = None) -> int:
        """Write frames without waiting; returns the epoch of the connection they went on.
        `epoch` (the one a batch began on): ConnectionError if the connection has changed
        since. OSError / ConnectionError when the peer cannot be reached."""
        with self._peer(address):
            try:
                sock, current = self._conn(address)
                if epoch is not None and current != epoch:
                    raise ConnectionError("the connection was replaced during the batch")
                _write_frames(sock, frames)
                return current
            except (OSError, ConnectionError):
                self._drop(address)
                raise

    def finish(self, address: str, epoch: int) -> None:
        """End the batch begun on connection `epoch` and wait until the peer has every frame
        of it; ConnectionError / OSError otherwise."""
        with self._peer(address):
            try:
                entry = self._conns.get(address)
                if entry is None or entry[1] != epoch:
                    raise ConnectionError("the connection was replaced during the batch")
                _finish(entry[0])
            except (OSError, ConnectionError):
                self._drop(address)
                raise

    def _peer(self, address: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(address, threading.Lock())

    def _conn(self, address: str) -> tuple[socket.socket, int]:
        entry = self._conns.get(address)
        if entry is not None:
            return entry
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._epoch += 1
            entry = self._conns[address] = (sock, self._epoch)
        return entry

    def _drop(self, address: str) -> None:
        entry = self._conns.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)


def _filed(key: tuple[bytes, int, int], value: bytes) -> tuple[bytes, bytes, int, int]:
    block_hash, first_layer, num_layers = key
    return block_hash, value, first_layer, num_layers


def _write_frames(sock: socket.socket, frames: Sequence[Frame]) -> int:
    """Length-prefixed frames, gathered into as few system calls as the kernel takes."""
    parts: list[bytes | memoryview] = []
    nbytes = 0
    for frame in frames:
        pieces = [frame] if isinstance(frame, bytes | bytearray) else list(frame)
        n = sum(memoryview(p).nbytes for p in pieces)
        if n == 0 or n > MAX_VALUE_BYTES:
            raise ValueError(f"a {n}-byte KV value cannot be framed")
        parts.append(_LEN.pack(n))
        parts.extend(pieces)
        nbytes += n
    _sendall_parts(sock, parts)
    return nbytes


def _sendall_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _finish(sock: socket.socket) -> None:
    sock.sendall(_LEN.pack(0))
    if _recv_exact(sock, 1) != ACK:
        raise ConnectionError("bad acknowledgement")


__all__ = ["KVInbox", "KVReceiver", "KVSender"]
