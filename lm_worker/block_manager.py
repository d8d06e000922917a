"""Paged KV cache bookkeeping: fixed-size blocks, a free list, and prefix caching.

A full block is identified by a hash chain (common/block_hash.py): hash(previous block's hash,
its token ids, the mm_hashes of media items whose placeholders fall in it). Two prompts with
the same text and different images therefore never share blocks. Freed blocks keep their hash
until reused, so a later request with the same prefix can take them back (LRU order of the free
list).

Block 0 is never handed out: padded slots of CUDA-graph batches write their KV there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.block_hash import extend_chain
from lm_worker.request import Request

NULL_BLOCK = 0


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and hashed


def extend_block_hashes(request: Request, num_tokens: int, block_size: int) -> list[bytes]:
    """Extend the request's hash chain to cover its full blocks among the first num_tokens
    tokens; returns the chain (cached on the request: each block is hashed once)."""
    return extend_chain(
        request.block_hashes, request.all_token_ids, request.mm_features, num_tokens, block_size
    )


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 2, "need at least one block besides the null block"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; cached ones keep their hash for reuse.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id (in use or free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ----------------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens. At least one
        token is always left to compute (the last one's logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        hashes = extend_block_hashes(request, request.num_tokens - 1, self.block_size)
        found = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def can_allocate(self, request: Request, num_new_tokens: int, cached: list[int]) -> bool:
        total = self.blocks_needed(len(cached) * self.block_size + num_new_tokens)
        reusable_free = sum(1 for b in cached if b in self.free)
        return total - len(cached) + reusable_free <= self.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int]) -> None:
        """Give a waiting request its cached prefix blocks and room for num_new_tokens more."""
        assert not request.block_ids
        for block_id in cached:
            self._take(block_id)
        request.block_ids = list(cached)
        request.num_computed_tokens = len(cached) * self.block_size
        self._grow(request, request.num_computed_tokens + num_new_tokens)

    # -- running ------------------------------------------------------------------------------

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return need - len(request.block_ids) <= self.num_free

    def append(self, request: Request, num_new_tokens: int) -> None:
        self._grow(request, request.num_computed_tokens + num_new_tokens)

    def commit_full_blocks(self, request: Request) -> None:
        """Hash the request's newly full blocks (after a step computed their KV)."""
        if not self.enable_prefix_caching:
            return
        # Blocks are allocated ahead of their KV, and the request's hash chain may already
        # reach past its computed tokens (`cached_prefix` hashes the whole prompt): only the
        # blocks whose every token is computed are offered for reuse. A block that a chunk
        # (or a request waiting for an embedding) has half filled is not.
        num_full = request.num_computed_tokens // self.block_size
        hashes = extend_block_hashes(request, request.num_computed_tokens, self.block_size)
        hashes = hashes[:num_full]
        done = request.num_committed_blocks
        for block_id, h in zip(request.block_ids[done:], hashes[done:], strict=False):
            block = self.blocks[block_id]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block_id
        request.num_committed_blocks = min(len(hashes), len(request.block_ids))

    def free_request(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted)."""
        # Reverse order: the tail of a sequence is the least likely to be shared, so it is
        # reused first.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
        request.block_ids = []
        request.num_committed_blocks = 0

    # -- internals ----------------------------------------------------------------------------

    def _grow(self, request: Request, num_tokens: int) -> None:
        while len(request.block_ids) < self.blocks_needed(num_tokens):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached identity
                del self.cached[block.hash]
                block.hash = None
            block.ref_count = 1
            request.block_ids.append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
