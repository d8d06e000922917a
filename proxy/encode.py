"""Encode dispatch: single flight across every proxy, split by load, retried elsewhere.

`submit(items)` returns one future per item. An item already being encoded for any request of
this proxy joins that encode (single flight). For the rest, the proxy first marks each item
"being encoded" in Redis (SET NX PX, a short TTL refreshed while the encode runs), so that
several proxies share single flight too:

    mark claimed      this proxy encodes it; the mark is dropped when the encode ends
    mark held         another proxy is encoding it: wait for its publication (the connector's
                      wait_for, woken by the put), one mark TTL at a time; when a wait ends
                      with the item still missing and the mark gone (that proxy died, or its
                      encode failed), claim it and encode it here

Items this proxy encodes are spread over the encoders by outstanding work (largest items first
onto the least loaded), one Encode call per chosen encoder. A call that fails without an answer
(the worker died, timed out, is draining) is retried on another encoder after a jittered
backoff; an item the encoder refuses (corrupt, unsupported) fails its future with BadInput. An
embedding store that is not answering (StoreUnavailable) fails the items at once: no encoder
could publish them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections import defaultdict
from typing import Any

import grpc

from common import tracing
from common.media import media_to_proto
from common.signing import HashSigner
from connector import AsyncECConnector, ConnectorError, StoreUnavailable
from proto import epd_pb2
from proxy.metrics import ProxyMetrics
from proxy.prepare import BadInput, PreparedItem
from proxy.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

# Codes that say the call never got an answer from a working encoder: try another one.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


class Unavailable(RuntimeError):
    """No worker could do it (UNAVAILABLE / HTTP 503)."""


def backoff(attempt: int) -> float:
    """Full jitter on 50 ms doubling, capped at 1 s."""
    return random.uniform(0, min(0.05 * 2**attempt, 1.0))


class EncodeDispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        metrics: ProxyMetrics,
        retries: int,
        connector: AsyncECConnector,
        mark_ttl: float,
    ):
        self.pool = pool
        self.metrics = metrics
        self.retries = retries
        self.connector = connector
        self.mark_ttl = mark_ttl
        self.mark_ttl_ms = max(int(mark_ttl * 1000), 1)
        # What this proxy writes in the marks it holds (only the owner extends or drops one).
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.inflight: dict[str, asyncio.Future] = {}
        # Signs each hash sent to an encoder (common/signing.py); set by Proxy.
        self.signer: HashSigner | None = None

    def submit(
        self, items: list[PreparedItem], deadline: float, parent: Any = None
    ) -> tuple[list[asyncio.Future], list[bool]]:
        """Futures of EncodeResult, one per item; and per item whether it joined an encode
        already in flight (single flight).

        `deadline` is the dispatch's own (the proxy's request timeout from now), never the
        first joiner's: an encode is shared, and one impatient client must not fail it for
        every request waiting on it (each waits under its own deadline). `parent`: the span
        the encode calls' spans are children of (common/tracing.py; None when off)."""
        loop = asyncio.get_running_loop()
        futures, new, joined = [], [], []
        for item in items:
            future = self.inflight.get(item.mm_hash)
            joined.append(future is not None)
            if future is None:
                future = self.inflight[item.mm_hash] = loop.create_future()
                new.append(item)
            futures.append(future)
        if new:
            self._spawn(self._claim_and_encode(new, deadline, parent))
        return futures, joined

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(_log_crash)

    async def _claim_and_encode(
        self, items: list[PreparedItem], deadline: float, parent: Any
    ) -> None:
        try:
            claimed = await self.connector.claim(
                [i.mm_hash for i in items], self.owner, self.mark_ttl_ms
            )
        except StoreUnavailable as e:
            # An encoder could not publish them: fail now rather than after its own deadline.
            self._fail(items, Unavailable(str(e)))
            return
        except ConnectorError as e:
            # Without Redis's answer the encode goes ahead here: at worst another proxy
            # encodes the item too (the encoder stores it once).
            logger.warning("could not mark %d items as being encoded: %s", len(items), e)
            claimed = [True] * len(items)
        mine = [i for i, ok in zip(items, claimed, strict=True) if ok]
        others = [i for i, ok in zip(items, claimed, strict=True) if not ok]
        self.metrics.encode_marks.labels("claimed").inc(len(mine))
        self.metrics.encode_marks.labels("followed").inc(len(others))
        for item in others:
            self._spawn(self._follow(item, deadline, parent))
        if mine:
            await self._encode_marked(mine, deadline, parent)

    async def _encode_marked(self, items: list[PreparedItem], deadline: float, parent: Any) -> None:
        """Encode items whose marks this proxy holds, keeping the marks alive meanwhile."""
        hashes = [i.mm_hash for i in items]
        keeper = asyncio.create_task(self._keep_marks(hashes))
        try:
            await self._dispatch(items, deadline, parent)
        finally:
            keeper.cancel()
            with contextlib.suppress(ConnectorError):
                await self.connector.release(hashes, self.owner)

    async def _keep_marks(self, hashes: list[str]) -> None:
        while True:
            await asyncio.sleep(self.mark_ttl / 3)
            try:
                await self.connector.extend(hashes, self.owner, self.mark_ttl_ms)
            except ConnectorError as e:
                logger.warning("could not extend the encoding marks: %s", e)

    async def _follow(self, item: PreparedItem, deadline: float, parent: Any) -> None:
        """Another proxy is encoding `item`: wait for its publication, and take the encode over
        if that proxy's mark lapses first."""
        h = item.mm_hash
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail([item], Unavailable(f"item {h} was not encoded before the deadline"))
                return
            try:
                missing = await self.connector.wait_for([h], min(remaining, self.mark_ttl))
            except StoreUnavailable as e:
                self._fail([item], Unavailable(str(e)))
                return
            except ConnectorError as e:
                logger.warning("waiting for %s: %s", h, e)
                missing = {h}
            if not missing:
                self._resolve(
                    h, epd_pb2.EncodeResult(mm_hash=h, outcome=epd_pb2.ENCODE_OUTCOME_HELD)
                )
                return
            try:
                (ours,) = await self.connector.claim([h], self.owner, self.mark_ttl_ms)
            except ConnectorError as e:
                logger.warning("could not check the encoding mark of %s (%s): encoding it", h, e)
                ours = True
            if ours:
                logger.info("taking over the encode of %s: its mark lapsed unpublished", h)
                self.metrics.encode_marks.labels("taken_over").inc()
                await self._encode_marked([item], deadline, parent)
                return

    def _resolve(self, mm_hash: str, result: epd_pb2.EncodeResult) -> None:
        future = self.inflight.pop(mm_hash, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def _dispatch(self, items: list[PreparedItem], deadline: float, parent: Any) -> None:
        groups: dict[str, list[PreparedItem]] = defaultdict(list)
        assigned: dict[str, int] = defaultdict(int)
        # Briefly wait for an encoder to come up (a restart, a registration).
        usable = await self.pool.wait_for(self.pool.usable, min(deadline - time.monotonic(), 2.0))
        if not usable:
            self._fail(items, Unavailable("no encoder worker is available"))
            return
        for item in sorted(items, key=lambda i: -i.grid.num_tokens):
            worker = min(usable, key=lambda w: (w.queued_tokens() + assigned[w.address], w.address))
            groups[worker.address].append(item)
            assigned[worker.address] += item.grid.num_tokens
        await asyncio.gather(
            *(
                self._call(self.pool.workers[a], group, deadline, parent)
                for a, group in groups.items()
            )
        )

    async def _call(
        self,
        worker: Worker,
        items: list[PreparedItem],
        deadline: float,
        parent: Any,
        attempt: int = 0,
    ) -> None:
        tokens = sum(i.grid.num_tokens for i in items)
        sign = self.signer.sign if self.signer is not None else lambda _h: b""
        request = epd_pb2.EncodeRequest(
            items=[
                epd_pb2.EncodeItem(
                    mm_hash=i.mm_hash, media=media_to_proto(i.media), mm_hash_tag=sign(i.mm_hash)
                )
                for i in items
            ]
        )
        worker.sent(tokens)
        started = time.perf_counter()
        tracer = tracing.tracer()
        span = tracer.start(
            "encode_call",
            parent,
            encoder=worker.address,
            items=len(items),
            tokens=tokens,
            attempt=attempt,
            mm_hashes=[i.mm_hash for i in items],
        )
        reply = None
        try:
            reply = await worker.stub.Encode(
                request,
                timeout=max(deadline - time.monotonic(), 0.01),
                metadata=tracer.metadata(span),
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError):
                if asyncio.current_task().cancelling():
                    self._fail(items, Unavailable("the proxy is shutting down"))
                    raise
                # Cancelled under us: the worker's channel was closed (it left the registry).
                code, details = grpc.StatusCode.UNAVAILABLE, "its connection was closed"
            else:
                code, details = e.code(), e.details()
            self.pool.failed(worker, f"Encode: {code.name}: {details}")
            tracer.end(span, answered=False, error=f"{code.name}: {details}")
            span = None  # a retry is a span of its own
            if code not in RETRYABLE or attempt + 1 >= self.retries:
                self._fail(items, Unavailable(f"encoder {worker.address}: {code.name}: {details}"))
                return
            self.metrics.retries.labels("encoder").inc()
            await asyncio.sleep(backoff(attempt))
            other = self.pool.pick(exclude={worker.address}) or self.pool.pick()
            if other is None:
                self._fail(items, Unavailable("no encoder worker is available"))
                return
            logger.info(
                "retrying %d items on %s (%s failed)", len(items), other.address, worker.address
            )
            await self._call(other, items, deadline, parent, attempt + 1)
            return
        finally:
            worker.finished(tokens)
            tracer.end(span, answered=reply is not None)
        self.metrics.encode_dispatch.observe(time.perf_counter() - started)
        self.pool.succeeded(worker)
        for item, result in zip(items, reply.results, strict=True):
            future = self.inflight.pop(item.mm_hash, None)
            if future is None or future.done():
                continue
            if result.outcome == epd_pb2.ENCODE_OUTCOME_FAILED:
                if result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                    future.set_exception(BadInput(result.error.message))
                else:
                    future.set_exception(Unavailable(result.error.message))
            else:
                future.set_result(result)

    def _fail(self, items: list[PreparedItem], error: Exception) -> None:
        for item in items:
            future = self.inflight.pop(item.mm_hash, None)
            if future is not None and not future.done():
                future.set_exception(error)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("encode dispatch crashed", exc_info=task.exception())
