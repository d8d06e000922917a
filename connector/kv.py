"""The shared KV tier: paged-KV blocks in Redis, keyed by the block-hash chain, on plain values.

    prefill / any LM worker ──put_many──▶ Redis ◀──get_many── decode / any LM worker

Key schema: `{namespace}:kv:{model fingerprint}:{{block hash hex}}`. The block hash is the LM
worker's prefix-cache chain (previous block's hash, the block's token ids, the mm_hashes of the
media whose placeholders fall in it), so a block is only ever found by a request with the same
tokens and the same media before and in it. The hash sits in a hash tag: blocks spread over a
Redis Cluster's nodes.

Every put is `SET key value EX ttl`; the memory bound is Redis's own (maxmemory with an LRU
policy, like the EC entries). A miss is a normal outcome (TTL, eviction, a flushed Redis): the
LM worker recomputes. A value that fails its checks is deleted, counted and reported as a miss,
never used.

One value per block, all layers, as a fixed 128-byte header + raw bytes (never pickle). The
direct path (connector/kv_stream.py) may carry a block as several values, one per layer range
(`first layer`, `number of layers`), each with its own checksum:

    offset size  field
    0      4     magic b"EPDK"
    4      1     format version (1)
    5      1     dtype code (wire.DTYPE_CODES)
    6      1     ndim (1..8)
    7      1     reserved (0)
    8      2     first layer
    10     2     number of layers
    12     4     valid token rows in the block (block_size for a full block, fewer for a tail)
    16     8     payload length in bytes (little endian)
    24     8     xxh3-64 of the payload
    32     16    block hash
    48     4*8   shape, one uint32 per dimension (unused ones 0)
    80     48    reserved (0)
    128    ...   the tensor's bytes, C order, little endian
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import torch
import xxhash

from connector.client import Mode, redact_url, sync_client
from connector.wire import DTYPE_CODES, WireError, checked_view, payload_of

logger = logging.getLogger(__name__)

MAGIC = b"EPDK"
VERSION = 1
HEADER_BYTES = 128
HASH_BYTES = 16
_FIXED = struct.Struct("<4sBBBBHHIQQ16s")  # then the shape: wire.payload_of's packing


@dataclass(frozen=True)
class KVBlock:
    """One decoded block: where it sits in the chain and its [layers, 2, block_size, ...]
    tensor (a view of the fetched bytes: read-only by contract)."""

    block_hash: bytes
    first_layer: int
    num_layers: int
    num_tokens: int
    tensor: torch.Tensor


def encode_block(
    block_hash: bytes, tensor: torch.Tensor, num_tokens: int, first_layer: int = 0
) -> bytes:
    """Header + payload of one block's KV (a CPU tensor whose first dimension is the layers)."""
    return b"".join(encode_block_parts(block_hash, tensor, num_tokens, first_layer))


def encode_block_parts(
    block_hash: bytes, tensor: torch.Tensor, num_tokens: int, first_layer: int = 0
) -> tuple[bytes, memoryview]:
    """`encode_block` as (header, payload view) not joined: a socket writes both without a
    copy. The view holds the (contiguous) tensor's memory: do not write into it meanwhile."""
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")
    payload, shape = payload_of(tensor)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        DTYPE_CODES[tensor.dtype],
        tensor.dim(),
        0,
        first_layer,
        tensor.shape[0],
        num_tokens,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload),
        block_hash,
    )
    return (fixed + shape).ljust(HEADER_BYTES, b"\0"), payload


def decode_block(value: bytes) -> KVBlock:
    """The block in `value`; WireError when any check fails (magic, version, dtype, lengths,
    checksum)."""
    if len(value) < HEADER_BYTES:
        raise WireError(f"value of {len(value)} bytes is shorter than the KV header")
    (magic, version, code, ndim, _, first, layers, tokens, nbytes, checksum, block_hash) = (
        _FIXED.unpack_from(value)
    )
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"KV format version {version}, this build reads {VERSION}")
    tensor = checked_view(value, HEADER_BYTES, _FIXED.size, code, ndim, nbytes, checksum)
    if tensor.shape[0] != layers:
        raise WireError(f"length mismatch: shape {tuple(tensor.shape)} for {layers} layers")
    return KVBlock(block_hash, first, layers, tokens, tensor)


def peek_hash(value: bytes) -> bytes:
    """The block hash in a value's header (ValueError when it has none); the rest is checked
    by `decode_block` when the value is used."""
    if len(value) < HEADER_BYTES or value[:4] != MAGIC:
        raise ValueError("not a KV value")
    return bytes(value[32 : 32 + HASH_BYTES])


def peek_key(value: bytes) -> tuple[bytes, int, int]:
    """(block hash, first layer, number of layers) from a value's header (ValueError when it
    has none): where a receiver files a block, or one layer range of it, before the value is
    checked by `decode_block` when used."""
    if len(value) < HEADER_BYTES or value[:4] != MAGIC:
        raise ValueError("not a KV value")
    first, layers = struct.unpack_from("<HH", value, 8)
    return bytes(value[32 : 32 + HASH_BYTES]), first, layers


class KVStore:
    """Blocks in Redis (blocking: LM workers call it from a worker thread). Plain values in,
    bytes out; checking a block against the cache layout is the caller's (`decode_block`)."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        namespace: str = "epd",
        ttl_seconds: int = 600,
        op_timeout: float = 5.0,
        retries: int = 3,
        mode: Mode = "standalone",
    ):
        self.url = url
        self.prefix = f"{namespace}:kv:{fingerprint}:"
        self.ttl_seconds = ttl_seconds
        self.client = sync_client(url, op_timeout, retries, mode)

    def key(self, block_hash: bytes) -> str:
        return f"{self.prefix}{{{block_hash.hex()}}}"

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store (block hash, encoded value) pairs; returns the bytes written."""
        if not items:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for block_hash, value in items:
            pipe.set(self.key(block_hash), value, ex=self.ttl_seconds)
        self._run(pipe, "put")
        return sum(len(v) for _, v in items)

    def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """The stored values of `hashes`, None for a miss."""
        if not hashes:
            return []
        pipe = self.client.pipeline(transaction=False)
        for block_hash in hashes:
            pipe.get(self.key(block_hash))
        return list(self._run(pipe, "get"))

    def delete(self, hashes: Sequence[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for block_hash in hashes:
            pipe.delete(self.key(block_hash))
        self._run(pipe, "delete")

    def close(self) -> None:
        self.client.close()

    def _run(self, pipe, op: str) -> list:
        started = time.monotonic()
        try:
            return pipe.execute()
        except redis.RedisError as e:
            raise KVStoreError(
                f"KV {op} on {redact_url(self.url)} failed after "
                f"{time.monotonic() - started:.1f}s: {e}"
            ) from e


class KVStoreError(RuntimeError):
    """Redis could not do what was asked; the message names the (redacted) URL and the cause."""


__all__ = [
    "KVBlock",
    "KVStore",
    "KVStoreError",
    "decode_block",
    "encode_block",
    "encode_block_parts",
    "peek_hash",
    "peek_key",
]
