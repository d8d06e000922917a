"""The prefix-cache block-hash chain, on plain values: a prompt's token ids and the media
spans (mm_hash, offset, length) in it.

A full block of `block_size` tokens is identified by hash(the previous block's hash, its token
ids, the mm_hashes of the media items whose placeholders fall in it). Two prompts with the same
text and different images therefore never share a block. The LM worker's block manager keys its
prefix cache (and the KV tier its values) by this chain; the proxy computes the same chain from
the prompt it prepared to route a request to the worker that holds its longest prefix. One
function serves both, so the two can never disagree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol


class MediaSpan(Protocol):
    """A media item's placeholders in a prompt (models.MMFeature, the proxy's PreparedItem)."""

    @property
    def mm_hash(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


def extend_chain(
    chain: list[bytes],
    token_ids: Sequence[int],
    spans: Sequence[MediaSpan],
    num_tokens: int,
    block_size: int,
) -> list[bytes]:
    """Extend `chain` (in place) to cover the full blocks among the first `num_tokens` of
    `token_ids`; returns it. Blocks already in the chain are not hashed again."""
    for start in range(len(chain) * block_size, num_tokens - block_size + 1, block_size):
        end = start + block_size
        h = hashlib.blake2b(chain[-1] if chain else b"", digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start:end]))
        for span in spans:
            if span.offset < end and start < span.offset + span.length:
                h.update(span.mm_hash.encode())
        chain.append(h.digest())
    return chain


def block_hashes(
    token_ids: Sequence[int], spans: Sequence[MediaSpan], block_size: int
) -> list[bytes]:
    """The chain of every full block of `token_ids`."""
    return extend_chain([], token_ids, spans, len(token_ids), block_size)


__all__ = ["MediaSpan", "block_hashes", "extend_chain"]
