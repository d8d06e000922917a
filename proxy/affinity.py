"""Prefix-cache affinity: send a request to the LM worker that already holds the longest prefix
of its prompt, unless that worker is much busier than the one load alone would pick.

The proxy keeps its own index of what it sent where: block hash -> the workers that computed
that block for a request that completed there (a whole run, a prefill stage, a decode stage).
The hashes are the workers' own prefix-cache chain (common/block_hash.py) over the prompt the
proxy prepared (token ids and media spans; the mm_hashes make two images behind the same text
different prefixes), at the block size each worker reports (`LMLoad.prefix_block_size`; 0: no
prefix cache, never preferred). The index is bounded (`proxy.prefix_affinity_blocks`, least
recently recorded dropped first; a chain is recorded tail first, so its head, which every
longer prompt shares, is the last to go).

NOTE: the index is the proxy's memory, not the worker's cache: a worker that evicted the blocks
since, restarted, or was reached by another proxy makes the hint wrong in either direction. A
wrong hint costs one prefill on a worker that was within the load margin anyway; the worker's
own prefix cache still decides what is reused, so output never depends on it.

The load rule: with `best` the worker holding the most prefix tokens (`held`) and `baseline` the
worker the plain rule picks (least queued tokens; for decode, most free KV blocks first), `best`
is taken when its queued tokens exceed the baseline's by at most min(held,
`proxy.prefix_affinity_margin_tokens`): the prefill work the hit saves must at least pay for the
extra queue it waits behind, and no hit is worth more than the margin. A prefix as short as a
chat template's head therefore never draws a burst of requests onto one worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.block_hash import MediaSpan, block_hashes
from proxy.workers import Worker


class PromptChains:
    """A prompt's block-hash chain at each block size asked for (computed once per size)."""

    def __init__(self, token_ids: Sequence[int], spans: Sequence[MediaSpan]):
        self.token_ids = token_ids
        self.spans = spans
        self._chains: dict[int, list[bytes]] = {}

    def of(self, block_size: int) -> list[bytes]:
        chain = self._chains.get(block_size)
        if chain is None:
            chain = self._chains[block_size] = block_hashes(self.token_ids, self.spans, block_size)
        return chain


class PrefixIndex:
    """Block hash -> addresses of the workers that computed it, LRU-bounded in blocks."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        # Tuples, not sets: most blocks have one holder, and a tuple of one is a quarter the size.
        self._holders: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, chain: Sequence[bytes], address: str) -> None:
        for h in reversed(chain):  # the head last: the most recently used, the last dropped
            holders = self._holders.get(h, ())
            if address not in holders:
                holders += (address,)
            self._holders[h] = holders
            self._holders.move_to_end(h)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def matched_blocks(self, chain: Sequence[bytes], address: str) -> int:
        """Leading blocks of `chain` recorded for `address`."""
        n = 0
        for h in chain:
            holders = self._holders.get(h)
            if holders is None or address not in holders:
                break
            n += 1
        return n


def prefix_block_size(worker: Worker) -> int:
    load = worker.load
    return 0 if load is None else load.prefix_block_size


class Affinity:
    """Chooses among candidate LM workers by held prefix, within a load margin. `max_blocks`
    0 turns it off (the plain rule alone)."""

    def __init__(self, max_blocks: int, margin_tokens: int, routes=None):
        self.index = PrefixIndex(max_blocks)
        self.enabled = max_blocks > 0
        self.margin_tokens = margin_tokens
        self.routes = routes  # Counter labelled by outcome (holder, load, none), or None

    def held_tokens(self, worker: Worker, chains: PromptChains) -> int:
        """Prompt tokens this worker is known to hold, as a prefix."""
        bs = prefix_block_size(worker)
        if not bs:
            return 0
        return self.index.matched_blocks(chains.of(bs), worker.address) * bs

    def choose(
        self, candidates: Sequence[Worker], baseline: Worker | None, chains: PromptChains | None
    ) -> Worker | None:
        """The candidate holding the longest prefix unless it is busier than `baseline` (what
        the plain rule picked) by more than the prefix it holds or the margin; `baseline` when
        nobody holds any."""
        if not self.enabled or chains is None or baseline is None:
            return baseline
        held = [(self.held_tokens(w, chains), w) for w in candidates]
        tokens, best = max(
            held, key=lambda p: (p[0], -p[1].queued_tokens(), p[1].address), default=(0, None)
        )
        if not tokens or best is None:
            self._count("none")
            return baseline
        if best.queued_tokens() - baseline.queued_tokens() > min(tokens, self.margin_tokens):
            self._count("load")
            return baseline
        self._count("holder")
        return best

    def record(self, worker: Worker, chains: PromptChains | None) -> None:
        """`worker` computed (or took over) the prompt: it holds the chain's blocks."""
        bs = prefix_block_size(worker)
        if self.enabled and chains is not None and bs:
            self.index.record(chains.of(bs), worker.address)

    def _count(self, outcome: str) -> None:
        if self.routes is not None:
            self.routes.labels(outcome).inc()


__all__ = ["Affinity", "PrefixIndex", "PromptChains", "prefix_block_size"]
