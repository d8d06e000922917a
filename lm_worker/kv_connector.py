"""The KV connector: paged-KV blocks that outlive one LM worker (the prefill / decode split,
prefix-cache hits across workers, a migrated request's re-prefill).

The interface has the shape of vLLM's KV connector, in two halves that both run on the engine
thread:

    scheduler side   num_matched_tokens(request, num_local)   tokens a remote holds past the
                                                              local prefix cache, at admission
                     on_allocated(request, local, remote)     the blocks those tokens go into
    runner side      load_kv(kv_cache)                        before the forward: copy them in
                     save_kv(requests, kv_cache)              after a step: its newly full
                                                              blocks go out (as computed)
                     request_finished(request_id)

and one servicer-side half, off the engine thread (it does the I/O, so a step never waits on
the network):

    prefetch(request, handover)   before the request reaches the engine: fetch and check the
                                  blocks its hash chain names (the leading run that is there)
    pending_saves(request_id)     the writes still in flight for it: the servicer awaits them
                                  before a handover's last message, so the decode worker that
                                  takes over finds every block

`SharedKVConnector` is the first backend: blocks in Redis (connector/kv.py) keyed by the
prefix-cache hash chain, which includes the mm_hashes of the media in and before each block.
A request handed over from a prefill worker (`handover`) also saves its last, partial block,
keyed by a hash of the chain so far and the tail's tokens, so the decode worker computes only
the new token. A block that fails its checksum or does not match this worker's KV layout is
deleted and counted, and the run stops there: those tokens are recomputed, never read.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from connector.kv import KVStore, KVStoreError, decode_block, encode_block
from connector.kv_stream import KVInbox, KVSender
from connector.wire import WireError
from lm_worker.block_manager import extend_block_hashes
from lm_worker.request import Request

logger = logging.getLogger(__name__)


class KVConnector:
    """The interface (and the no-op backend: nothing remote, nothing saved)."""

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        return 0

    def on_allocated(self, request: Request, num_local_tokens: int, num_remote_tokens: int) -> None:
        pass

    def load_kv(self, kv_cache: torch.Tensor) -> None:
        pass

    def save_kv(self, requests: list[Request], kv_cache: torch.Tensor) -> None:
        pass

    def request_finished(self, request_id: str) -> None:
        pass

    def prefetch(self, request: Request, handover: bool = False, target: str = "") -> int:
        return 0

    def pending_saves(self, request_id: str) -> list[concurrent.futures.Future]:
        return []

    def close(self) -> None:
        pass


class KVMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.bytes = Counter(
            "epd_lm_kv_bytes", "KV bytes moved to / from the KV tier", ["direction"], **kw
        )
        self.blocks = Counter(
            "epd_lm_kv_blocks",
            "KV blocks: saved, pulled (loaded into the cache), corrupt (failed a check, deleted)",
            ["result"],
            **kw,
        )
        self.seconds = Histogram(
            "epd_lm_kv_transfer_seconds",
            "One KV transfer (a step's saves, a request's fetch)",
            ["op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            **kw,
        )
        self.recent: deque[float] = deque(maxlen=1024)  # the last transfers' seconds, any op

    def observe(self, op: str, seconds: float) -> None:
        self.seconds.labels(op).observe(seconds)
        self.recent.append(seconds)

    def percentiles(self) -> tuple[float, float]:
        """p50 and p99 seconds of the recent transfers (0 when there was none)."""
        recent = sorted(self.recent)
        if not recent:
            return 0.0, 0.0
        return recent[len(recent) // 2], recent[min(len(recent) - 1, len(recent) * 99 // 100)]


@dataclass
class _Fetched:
    """A request's blocks found in the tier: leading full blocks, then maybe its tail."""

    full: list[torch.Tensor] = field(default_factory=list)
    tail: torch.Tensor | None = None
    num_tokens: int = 0  # tokens these cover


def tail_hash(request: Request, num_tokens: int, block_size: int) -> bytes | None:
    """The key of the partial block that ends at `num_tokens` (None when it ends on a block
    boundary): the chain before it, the tail's token ids and the media overlapping it."""
    full = num_tokens // block_size
    start = full * block_size
    if start == num_tokens:
        return None
    chain = extend_block_hashes(request, num_tokens, block_size)
    h = hashlib.blake2b(chain[full - 1] if full else b"", digest_size=16)
    h.update(b"tail")
    h.update(b"".join(t.to_bytes(4, "little") for t in request.all_token_ids[start:num_tokens]))
    for f in request.mm_features:
        if f.offset < num_tokens and start < f.offset + f.length:
            h.update(f.mm_hash.encode())
    return h.digest()


class SharedKVConnector(KVConnector):
    def __init__(
        self,
        store: KVStore,
        block_size: int,
        block_shape: tuple[int, ...],  # one block, all layers: [L, 2, block_size, kvh, d]
        dtype: torch.dtype,
        registry: CollectorRegistry | None = REGISTRY,
        sender: KVSender | None = None,
        inbox: KVInbox | None = None,
    ):
        self.store = store
        # The direct path (backend "direct"): a handover's blocks go to its decode worker's
        # inbox over a kept connection, and this worker's inbox is read before Redis.
        self.sender = sender
        self.inbox = inbox
        self.block_size = block_size
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.metrics = KVMetrics(registry)
        self._lock = threading.Lock()  # the dicts below are shared with the servicer thread
        self._fetched: dict[str, _Fetched] = {}
        self._handover: set[str] = set()
        self._targets: dict[str, str] = {}  # request id -> its decode worker's KV address
        self._saves: dict[str, list[concurrent.futures.Future]] = {}
        # Engine thread only.
        self._saved: dict[str, int] = {}  # leading full blocks known to be in the tier
        self._tail_saved: set[str] = set()
        self._pending: list[tuple[int, torch.Tensor]] = []  # (block id, KV) to load
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-save")

    # -- servicer side ------------------------------------------------------------------------

    def prefetch(self, request: Request, handover: bool = False, target: str = "") -> int:
        """Fetch the leading run of the request's blocks the tier holds (blocking: call it from
        a worker thread, before the engine has the request). Returns the tokens they cover.
        `handover`: the request is a prefill stage; its tail block is saved for the decode
        worker, sent straight to `target` (its KV address) when there is one."""
        if handover:
            with self._lock:
                self._handover.add(request.request_id)
                if target and self.sender is not None:
                    self._targets[request.request_id] = target
        limit = request.num_tokens - 1  # the last token is always computed (its logits)
        bs = self.block_size
        hashes = list(extend_block_hashes(request, limit, bs)[: limit // bs])
        tail = tail_hash(request, limit, bs)
        if tail is not None:
            hashes.append(tail)
        if not hashes:
            return 0
        started = time.monotonic()
        try:
            values = self._get_many(hashes)
        except KVStoreError as e:
            logger.warning("%s: KV fetch failed (%s): recomputing", request.request_id, e)
            return 0
        fetched = _Fetched()
        corrupt = []
        for i, (h, value) in enumerate(zip(hashes, values, strict=True)):
            if value is None:
                break
            self.metrics.bytes.labels("received").inc(len(value))
            try:
                block = self._check(decode_block(value), h)
            except WireError as e:
                logger.warning(
                    "%s: KV block %s is corrupt (%s): recomputed", request.request_id, h.hex(), e
                )
                corrupt.append(h)
                break
            if i < limit // bs:
                fetched.full.append(block)
                fetched.num_tokens += bs
            else:
                fetched.tail = block
                fetched.num_tokens = limit
        if corrupt:
            self.metrics.blocks.labels("corrupt").inc(len(corrupt))
            try:
                self.store.delete(corrupt)
            except KVStoreError as e:
                logger.warning("deleting corrupt KV blocks failed: %s", e)
        self.metrics.observe("fetch", time.monotonic() - started)
        if fetched.num_tokens:
            with self._lock:
                self._fetched[request.request_id] = fetched
        return fetched.num_tokens

    def _get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """The inbox's values (direct path) first, Redis for the rest."""
        values = self.inbox.take_many(hashes) if self.inbox is not None else [None] * len(hashes)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            for i, value in zip(
                missing, self.store.get_many([hashes[i] for i in missing]), strict=True
            ):
                values[i] = value
        return values

    def _check(self, block, expected_hash: bytes) -> torch.Tensor:
        if block.block_hash != expected_hash:
            raise WireError(f"the value holds block {block.block_hash.hex()}")
        t = block.tensor
        if tuple(t.shape) != self.block_shape or t.dtype != self.dtype or block.first_layer:
            raise WireError(
                f"layout {tuple(t.shape)} {t.dtype} from layer {block.first_layer}; this "
                f"worker's is {self.block_shape} {self.dtype}"
            )
        return t

    def pending_saves(self, request_id: str) -> list[concurrent.futures.Future]:
        """The request's writes in flight (taken: a second call returns none)."""
        with self._lock:
            return self._saves.pop(request_id, [])

    # -- scheduler side -----------------------------------------------------------------------

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        with self._lock:
            fetched = self._fetched.get(request.request_id)
        if fetched is None or num_local_tokens % self.block_size:
            return 0
        covered = min(fetched.num_tokens, request.num_tokens - 1)
        return max(covered - num_local_tokens, 0)

    def on_allocated(self, request: Request, num_local_tokens: int, num_remote_tokens: int) -> None:
        rid = request.request_id
        bs = self.block_size
        known = (num_local_tokens + num_remote_tokens) // bs
        self._saved[rid] = max(self._saved.get(rid, 0), known)
        with self._lock:
            fetched = self._fetched.pop(rid, None)  # loaded once; a preemption recomputes
        if not num_remote_tokens or fetched is None:
            return
        end = num_local_tokens + num_remote_tokens
        for index in range(num_local_tokens // bs, -(-end // bs)):
            kv = fetched.full[index] if index < len(fetched.full) else fetched.tail
            self._pending.append((request.block_ids[index], kv))
        if end % bs:  # the tail came from the tier: never saved again from here
            self._tail_saved.add(rid)

    # -- runner side --------------------------------------------------------------------------

    def load_kv(self, kv_cache: torch.Tensor) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        started = time.monotonic()
        ids = torch.as_tensor([b for b, _ in pending], device=kv_cache.device)
        data = torch.stack([kv for _, kv in pending], dim=2).to(kv_cache.device, kv_cache.dtype)
        kv_cache.index_copy_(2, ids, data)
        self.metrics.blocks.labels("pulled").inc(len(pending))
        self.metrics.observe("load", time.monotonic() - started)

    def save_kv(self, requests: list[Request], kv_cache: torch.Tensor) -> None:
        """Send the blocks this step completed: full blocks, and a handover's tail once its
        prompt is computed. The KV is copied out here (the blocks may be reused right after);
        encoding and the write run on the writer thread."""
        bs = self.block_size
        for request in requests:
            rid = request.request_id
            computed = request.num_computed_tokens
            full = computed // bs
            saved = self._saved.get(rid, 0)
            items: list[tuple[bytes, int, int]] = []  # (hash, block id, valid tokens)
            if full > saved:
                chain = extend_block_hashes(request, computed, bs)
                for i in range(saved, full):
                    items.append((chain[i], request.block_ids[i], bs))
                self._saved[rid] = full
            with self._lock:
                handover = rid in self._handover
            if (
                handover
                and computed == request.num_prompt_tokens
                and computed % bs
                and rid not in self._tail_saved
            ):
                items.append(
                    (tail_hash(request, computed, bs), request.block_ids[full], computed % bs)
                )
                self._tail_saved.add(rid)
            if not items:
                continue
            ids = torch.as_tensor([b for _, b, _ in items], device=kv_cache.device)
            data = kv_cache.index_select(2, ids).to("cpu")
            with self._lock:
                target = self._targets.get(rid, "")
            future = self._writer.submit(self._write, items, data, target)
            with self._lock:
                self._saves.setdefault(rid, []).append(future)

    def _write(self, items: list[tuple[bytes, int, int]], data: torch.Tensor, target: str) -> None:
        started = time.monotonic()
        values = [(h, encode_block(h, data[:, :, j], n)) for j, (h, _, n) in enumerate(items)]
        if target:
            try:
                nbytes = self.sender.send(target, [v for _, v in values])
                self.metrics.bytes.labels("sent").inc(nbytes)
                self.metrics.blocks.labels("sent_direct").inc(len(values))
                self.metrics.observe("send", time.monotonic() - started)
                return
            except (OSError, ConnectionError) as e:
                # The decode worker looks in Redis after its inbox: the blocks go there.
                logger.warning("KV send to %s failed (%s): writing to Redis", target, e)
                self.metrics.blocks.labels("direct_failed").inc(len(values))
        try:
            nbytes = self.store.put_many(values)
        except KVStoreError as e:
            # The blocks are not in the tier: a later reader recomputes them.
            logger.warning("KV save of %d blocks failed: %s", len(values), e)
            raise
        self.metrics.bytes.labels("sent").inc(nbytes)
        self.metrics.blocks.labels("saved").inc(len(values))
        self.metrics.observe("save", time.monotonic() - started)

    def request_finished(self, request_id: str) -> None:
        self._saved.pop(request_id, None)
        self._tail_saved.discard(request_id)
        with self._lock:
            self._fetched.pop(request_id, None)
            self._handover.discard(request_id)
            self._targets.pop(request_id, None)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()
        if self.sender is not None:
            self.sender.close()


__all__ = ["KVConnector", "KVMetrics", "SharedKVConnector", "tail_hash"]
