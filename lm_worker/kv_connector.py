"""The KV connector: paged-KV blocks that outlive one LM worker (the prefill / decode split,
prefix-cache hits across workers, a migrated request's re-prefill).

The interface has the shape of vLLM's KV connector, in two halves that both run on the engine
thread:

    scheduler side   num_matched_tokens(request, num_local)   tokens a remote holds past the
                                                              local prefix cache, at admission
                     on_allocated(request, local, remote)     the blocks those tokens go into
    runner side      load_kv(kv_cache)                        before the forward: copy them in
                     start_save(requests, counts, kv_cache)   before the forward: the blocks
                                                              this step completes that go out
                                                              layer by layer (True: some do)
                     save_kv_layer(layer, layer_kv)           in the forward, as each layer's
                                                              KV is written to the cache
                     wait_for_save()                          after the forward: the step's
                                                              layer sends end (not waited for
                                                              here: see pending_saves)
                     abort_save()                             the forward failed
                     save_kv(requests, kv_cache)              after a step: its other newly
                                                              full blocks go out
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
With a sender (the direct backend), a handover's blocks go to its decode worker's inbox
instead, and with `layerwise` they go as they are computed: before the forward, `start_save`
lists the blocks the step completes for requests with a target; as the attention writes layer
l into the cache, `save_kv_layer` copies layer l of those blocks out (engine thread) and the
writer thread encodes and writes them to the kept connection while layers l+1.. compute;
`wait_for_save` queues the step's end (any layer the hook did not see, then the
acknowledgement). The servicer awaits that before the handover's last message. A send that
fails is redone whole on a new connection, then the full blocks go to Redis. The receiving
inbox hands a block out only once every layer of it is in; each layer's value is checked
(checksum, hash, layout, layer order) before the block is used.
A request handed over from a prefill worker (`handover`) also saves its last, partial block,
keyed by a hash of the chain so far and the tail's tokens, so the decode worker computes only
the new token. A block that fails its checksum or does not match this worker's KV layout is
deleted and counted, and the run stops there: those tokens are recomputed, never read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from connector.kv import KVStore, KVStoreError, decode_block, encode_block, encode_block_parts
from connector.kv_stream import KVInbox, KVSender
from connector.wire import WireError
from lm_worker.block_manager import extend_block_hashes
from lm_worker.request import Request

logger = logging.getLogger(__name__)


class KVConnector:
    """The interface, each method a no-op by default (see `NoKVConnector`)."""

    metrics: KVMetrics | None = None  # a backend's transfer counters (GetLoad's kv_* fields)

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        return 0

    def on_allocated(self, request: Request, num_local_tokens: int, num_remote_tokens: int) -> None:
        pass

    def load_kv(self, kv_cache: torch.Tensor) -> None:
        pass

    def start_save(
        self, requests: list[Request], num_scheduled: list[int], kv_cache: torch.Tensor
    ) -> bool:
        return False

    def save_kv_layer(self, layer: int, layer_kv: torch.Tensor) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def abort_save(self) -> None:
        pass

    def save_kv(self, requests: list[Request], kv_cache: torch.Tensor) -> None:
        pass

    def request_finished(self, request_id: str) -> None:
        pass

    def prefetch(self, request: Request, handover: bool = False, target: str = "") -> int:
        return 0

    async def prefetch_async(
        self, request: Request, handover: bool = False, target: str = ""
    ) -> int:
        """`prefetch` from the servicer's event loop: in place where it does no I/O (this
        no-op); a backend that does I/O runs it on a worker thread."""
        return self.prefetch(request, handover, target)

    def pending_saves(self, request_id: str) -> list[concurrent.futures.Future]:
        return []

    def close(self) -> None:
        pass


class NoKVConnector(KVConnector):
    """KV transfer off: nothing remote, nothing saved. The engine, the scheduler and the
    servicer call it as they would a real backend, so none of them tests for a connector."""


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
            "One KV transfer: a step's saves or sends (the writer's seconds on them; layer by "
            "layer they run beside the forward), a request's fetch, a load",
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


@dataclass
class _Group:
    """One step's blocks for one decode worker."""

    target: str
    hashes: list[bytes]
    num_tokens: list[int]  # valid rows of each block
    start: int  # its first block's row in the step's block list
    frames: list[tuple[bytes, memoryview]] = field(default_factory=list)  # sent so far
    nbytes: int = 0
    epoch: int | None = None
    error: Exception | None = None  # the send failed: redone whole at the step's end


@dataclass
class _Step:
    """A forward's layer-by-layer sends. The engine thread fills `layers_saved`; the writer
    thread, everything in the groups and `data`."""

    kv_cache: torch.Tensor
    ids: torch.Tensor  # the block ids, every group's in turn
    groups: list[_Group]
    request_ids: list[str]
    rollback: dict[str, tuple[int, bool]]  # request id -> (saved blocks, tail saved) before
    layers_saved: set[int] = field(default_factory=set)
    data: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, 2, bs, kvh, d]
    busy: float = 0.0  # writer seconds spent on it


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
        layerwise: bool = True,
    ):
        self.store = store
        # Direct sends go layer by layer, overlapped with the forward (else after the step).
        self.layerwise = layerwise
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
        self._step: _Step | None = None  # the forward under way's layer sends
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-save")

    # -- servicer side ------------------------------------------------------------------------

    async def prefetch_async(
        self, request: Request, handover: bool = False, target: str = ""
    ) -> int:
        return await asyncio.to_thread(self.prefetch, request, handover, target)

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
            self.metrics.bytes.labels("received").inc(sum(len(v) for v in value))
            try:
                block = self._assemble(value, h)
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

    def _get_many(self, hashes: list[bytes]) -> list[list[bytes] | None]:
        """Each block's values: the inbox's (direct path: all its layers in) first, Redis's
        (one value) for the rest."""
        num_layers = self.block_shape[0]
        if self.inbox is not None:
            values = self.inbox.take_many(hashes, num_layers)
        else:
            values = [None] * len(hashes)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            for i, value in zip(
                missing, self.store.get_many([hashes[i] for i in missing]), strict=True
            ):
                values[i] = None if value is None else [value]
        return values

    def _assemble(self, values: list[bytes], expected_hash: bytes) -> torch.Tensor:
        """One block from its values (the whole block, or layer ranges in order), each checked:
        header and checksum, hash, layout, and the layers covered once each with no gap."""
        parts, covered, rows = [], 0, None
        for value in values:
            block = decode_block(value)
            if block.block_hash != expected_hash:
                raise WireError(f"the value holds block {block.block_hash.hex()}")
            t = block.tensor
            if tuple(t.shape[1:]) != self.block_shape[1:] or t.dtype != self.dtype:
                raise WireError(
                    f"layout {tuple(t.shape)} {t.dtype}; this worker's is {self.block_shape} "
                    f"{self.dtype}"
                )
            if block.first_layer != covered or rows not in (None, block.num_tokens):
                raise WireError(
                    f"layers from {block.first_layer} ({block.num_tokens} rows) after "
                    f"{covered} layers ({rows} rows)"
                )
            covered += block.num_layers
            rows = block.num_tokens
            parts.append(t)
        if covered != self.block_shape[0]:
            raise WireError(f"{covered} of {self.block_shape[0]} layers")
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
        with self._lock:
            fetched = self._fetched.pop(rid, None)  # loaded once; a preemption recomputes
            # A request sent to a decode worker sends every block, those it found here or in
            # the tier too: they are in neither the decode worker's inbox nor Redis.
            direct = rid in self._targets
        known = (num_local_tokens + num_remote_tokens) // bs
        if not direct:
            self._saved[rid] = max(self._saved.get(rid, 0), known)
        if not num_remote_tokens or fetched is None:
            return
        end = num_local_tokens + num_remote_tokens
        for index in range(num_local_tokens // bs, -(-end // bs)):
            kv = fetched.full[index] if index < len(fetched.full) else fetched.tail
            self._pending.append((request.block_ids[index], kv))
        if end % bs and not direct:  # the tail came from the tier: never saved again from here
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

    def start_save(
        self, requests: list[Request], num_scheduled: list[int], kv_cache: torch.Tensor
    ) -> bool:
        """Before a forward: the blocks it completes for requests whose KV goes straight to a
        decode worker (full blocks, and a handover's tail once its prompt is in), to be sent
        layer by layer as the forward writes them. They count as saved from here (`save_kv`
        skips them; `abort_save` undoes it). True when there is any."""
        if not self.layerwise or self.sender is None:
            return False
        bs = self.block_size
        groups: dict[str, list[tuple[bytes, int, int]]] = {}  # target -> (hash, block, rows)
        rollback: dict[str, tuple[int, bool]] = {}
        for request, n in zip(requests, num_scheduled, strict=True):
            rid = request.request_id
            with self._lock:
                target = self._targets.get(rid, "")
                handover = rid in self._handover
            if not target:
                continue
            end = request.num_computed_tokens + n
            full = end // bs
            saved = self._saved.get(rid, 0)
            items = []
            if full > saved:
                chain = extend_block_hashes(request, end, bs)
                items += [(chain[i], request.block_ids[i], bs) for i in range(saved, full)]
            tail = (
                handover
                and end == request.num_prompt_tokens
                and end % bs != 0
                and rid not in self._tail_saved
            )
            if tail:
                items.append((tail_hash(request, end, bs), request.block_ids[full], end % bs))
            if not items:
                continue
            rollback[rid] = (saved, rid in self._tail_saved)
            self._saved[rid] = max(saved, full)
            if tail:
                self._tail_saved.add(rid)
            groups.setdefault(target, []).extend(items)
        if not groups:
            return False
        step_groups, ids, start = [], [], 0
        for target, items in groups.items():
            step_groups.append(
                _Group(target, [h for h, _, _ in items], [n for _, _, n in items], start)
            )
            ids += [b for _, b, _ in items]
            start += len(items)
        self._step = _Step(
            kv_cache,
            torch.as_tensor(ids, device=kv_cache.device),
            step_groups,
            list(rollback),
            rollback,
        )
        return True

    def save_kv_layer(self, layer: int, layer_kv: torch.Tensor) -> None:
        """Layer `layer` of the step's blocks is in the cache (`layer_kv`: that layer's
        [2, num_blocks, block_size, kvh, d]): copy it out and queue it for the writer."""
        if self._step is not None:
            self._queue_layer(self._step, layer, layer_kv)

    def _queue_layer(self, step: _Step, layer: int, layer_kv: torch.Tensor) -> None:
        if layer in step.layers_saved:
            return
        step.layers_saved.add(layer)
        data = layer_kv.index_select(1, step.ids).to("cpu")  # a copy: the cache moves on
        self._writer.submit(self._send_layer, step, layer, data)

    def wait_for_save(self) -> None:
        """The forward is done: send any layer the hook did not see (a forward replayed from
        a graph, a model that calls no hook), then end the step's batches. The writer does
        that; the servicer awaits it (`pending_saves`) before a handover's last message."""
        step, self._step = self._step, None
        if step is None:
            return
        for layer in range(step.kv_cache.shape[0]):
            self._queue_layer(step, layer, step.kv_cache[layer])
        future = self._writer.submit(self._finish_step, step)
        with self._lock:
            for rid in step.request_ids:
                self._saves.setdefault(rid, []).append(future)

    def abort_save(self) -> None:
        """The forward failed: its blocks are not saved (a rerun plans them again); what went
        out of them is incomplete in the receiver's inbox, a miss for its reader."""
        step, self._step = self._step, None
        if step is None:
            return
        for rid, (saved, tail) in step.rollback.items():
            self._saved[rid] = saved
            if not tail:
                self._tail_saved.discard(rid)

    def _send_layer(self, step: _Step, layer: int, data: torch.Tensor) -> None:
        """Writer thread: one layer of the step's blocks, one value per block, on each
        group's connection (no wait for the peer)."""
        started = time.monotonic()
        blocks = data.transpose(0, 1).contiguous()  # [n, 2, bs, kvh, d]
        step.data[layer] = blocks
        for group in step.groups:
            frames = [
                encode_block_parts(h, blocks[group.start + j].unsqueeze(0), rows, layer)
                for j, (h, rows) in enumerate(zip(group.hashes, group.num_tokens, strict=True))
            ]
            group.frames += frames
            if group.error is not None:
                continue
            try:
                group.epoch = self.sender.send_frames(group.target, frames, group.epoch)
                group.nbytes += sum(len(h) + p.nbytes for h, p in frames)
            except (OSError, ConnectionError) as e:
                group.error = e
        step.busy += time.monotonic() - started

    def _finish_step(self, step: _Step) -> None:
        """Writer thread: each group's acknowledgement; a group whose send failed is sent
        again whole (a new connection), then its full blocks go to Redis."""
        failed: KVStoreError | None = None
        for group in step.groups:
            started = time.monotonic()
            n = len(group.hashes)
            if group.error is None:
                try:
                    self.sender.finish(group.target, group.epoch)
                except (OSError, ConnectionError) as e:
                    group.error = e
            if group.error is not None:
                logger.info("KV sends to %s failed (%s): resending", group.target, group.error)
                try:
                    group.nbytes = self.sender.send(group.target, group.frames)
                    group.error = None
                except (OSError, ConnectionError) as e:
                    logger.warning("KV send to %s failed (%s): writing to Redis", group.target, e)
                    self.metrics.blocks.labels("direct_failed").inc(n)
            step.busy += time.monotonic() - started
            if group.error is None:
                self.metrics.bytes.labels("sent").inc(group.nbytes)
                self.metrics.blocks.labels("sent_direct").inc(n)
                continue
            data = torch.stack([step.data[layer] for layer in sorted(step.data)], dim=1)
            values = [
                (h, encode_block(h, data[group.start + j], rows))
                for j, (h, rows) in enumerate(zip(group.hashes, group.num_tokens, strict=True))
            ]
            started = time.monotonic()
            try:
                nbytes = self.store.put_many(values)
            except KVStoreError as e:
                # Not in the tier either: the decode worker recomputes them.
                logger.warning("KV save of %d blocks failed: %s", len(values), e)
                failed = failed or e
                continue
            self.metrics.bytes.labels("sent").inc(nbytes)
            self.metrics.blocks.labels("saved").inc(len(values))
            self.metrics.observe("save", time.monotonic() - started)
        self.metrics.observe("send", step.busy)
        if failed is not None:
            raise failed

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
