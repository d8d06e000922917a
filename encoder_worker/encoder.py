"""`execute_mm_encoder`: the encode half of multimodal serving, and never the gather half.

    Encode call -> check hashes -> held? (has_many, one round trip; held items stop here)
                -> prepare (decode + preprocess on a thread pool, off the event loop)
                -> BatchQueue, shared by every concurrent call (token budget, item cap)
                -> tower (one batch per forward, on its own thread)
                -> put(mm_hash) per item (SET NX + TTL) -> that item's callers

An encoder-only worker has nothing to gather: it publishes each output under the mm_hash the
proxy computed and forgets it. So an item the cache already holds is not an error and not a
crash (vLLM's encoder-only instance died with "Encoder cache miss" by running the gather half it
never needed): it is skipped before any preprocessing and reported HELD, and so is an item that
another encoder publishes while this one encodes it.

One mm_hash is encoded at most once at a time here: duplicates within a call share the first
occurrence's result; a call asking for a hash another call is already encoding waits for that
encode and reports it HELD. A bad item fails alone; the rest of its call and batch go on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

import torch

from common import tracing
from common.config import EncoderConfig
from common.tracing import Stage, Stages
from connector import AsyncECConnector, ConnectorError
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.tower import Tower
from models import MediaError, MediaInput, ProcessedMedia

logger = logging.getLogger(__name__)

Outcome = Literal["stored", "held", "failed"]
ErrorKind = Literal["invalid_argument", "permission_denied", "unavailable", "internal"]

# GetLoad's rates cover this many recent seconds.
LOAD_WINDOW_SECONDS = 10.0


@dataclass(frozen=True)
class EncodeItem:
    mm_hash: str  # computed by the proxy; published under as it is, never re-hashed
    media: MediaInput


@dataclass(frozen=True)
class ItemResult:
    mm_hash: str
    outcome: Outcome
    num_embeddings: int = 0
    width: int = 0  # channels per embedding
    dtype: torch.dtype | None = None
    nbytes: int = 0  # entry bytes this call stored (0 unless stored)
    error_kind: ErrorKind | None = None
    error: str = ""
    encode_seconds: float = 0.0
    # Where its time went here (common/tracing.py): held_check, or preprocess, queue_wait,
    # tower and publish.
    stages: tuple[Stage, ...] = ()

    @classmethod
    def failed(cls, mm_hash: str, kind: ErrorKind, error: str, seconds: float) -> ItemResult:
        return cls(mm_hash, "failed", error_kind=kind, error=error, encode_seconds=seconds)


@dataclass(frozen=True)
class EncoderLoad:
    queued_items: int  # accepted, not yet in the tower (preprocessing or waiting)
    queued_tokens: int  # their embeddings, where the header has been read
    running_items: int  # in the tower or being published
    items_per_second: float  # through the tower, recent window
    busy_fraction: float  # of recent wall time the tower was running
    batch_items: float = 0.0  # mean items per forward, recent window


class _Job:
    """One mm_hash being encoded here; every call that wants it awaits `done`."""

    __slots__ = (
        "accepted",
        "done",
        "media",
        "mm_hash",
        "num_tokens",
        "processed",
        "queued",
        "running",
        "stages",
    )

    def __init__(self, item: EncodeItem, done: asyncio.Future):
        self.mm_hash = item.mm_hash
        self.media = item.media
        self.accepted = time.monotonic()
        self.num_tokens = 0  # known once the header is read (preprocessing thread)
        self.processed: ProcessedMedia | None = None
        self.running = False
        self.done: asyncio.Future[ItemResult] = done
        self.stages = Stages()
        self.queued = 0  # wall-clock ns it joined the batch queue


class BatchQueue:
    """Prepared items waiting for the tower, first come first served. `schedule` cuts the next
    batch: up to `max_items` items and `max_tokens` embeddings; an item larger than the token
    budget goes alone. Never skips ahead, so no item starves behind smaller ones."""

    def __init__(self, max_items: int, max_tokens: int):
        self.max_items = max_items
        self.max_tokens = max_tokens
        self._jobs: deque[_Job] = deque()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: _Job) -> None:
        self._jobs.append(job)
        self.tokens += job.num_tokens

    def full(self) -> bool:
        return len(self._jobs) >= self.max_items or self.tokens >= self.max_tokens

    def schedule(self) -> list[_Job]:
        batch: list[_Job] = []
        tokens = 0
        while self._jobs and len(batch) < self.max_items:
            head = self._jobs[0]
            if batch and tokens + head.num_tokens > self.max_tokens:
                break
            batch.append(self._jobs.popleft())
            tokens += head.num_tokens
        self.tokens -= tokens
        return batch


class _Activity:
    """Items through the tower and tower busy time, over the last `window` seconds."""

    def __init__(self, window: float = LOAD_WINDOW_SECONDS):
        self.window = window
        self.created = time.monotonic()
        self.batches: deque[tuple[float, float, int]] = deque()  # (start, end, items)
        self.running_since: float | None = None

    def begin(self) -> None:
        self.running_since = time.monotonic()

    def end(self, items: int) -> None:
        now = time.monotonic()
        assert self.running_since is not None
        self.batches.append((self.running_since, now, items))
        self.running_since = None
        while self.batches and self.batches[0][1] < now - self.window:
            self.batches.popleft()

    def rates(self) -> tuple[float, float]:
        """(items per second, busy fraction)."""
        now = time.monotonic()
        horizon = now - self.window
        span = max(min(self.window, now - self.created), 1e-3)
        recent = [b for b in self.batches if b[1] > horizon]
        busy = sum(end - max(start, horizon) for start, end, _ in recent)
        if self.running_since is not None:
            busy += now - max(self.running_since, horizon)
        return sum(n for _, _, n in recent) / span, min(busy / span, 1.0)

    def mean_batch(self) -> float:
        """Mean items per forward over the window (0 when there was none)."""
        horizon = time.monotonic() - self.window
        recent = [n for _, end, n in list(self.batches) if end > horizon]
        return sum(recent) / len(recent) if recent else 0.0


class MMEncoder:
    """The encoder-only engine: `execute_mm_encoder` per call, one batch loop for all calls."""

    def __init__(
        self,
        tower: Tower,
        connector: AsyncECConnector,
        config: EncoderConfig,
        metrics: EncoderMetrics,
    ):
        self.tower = tower
        self.connector = connector
        self.config = config
        self.metrics = metrics
        self.queue = BatchQueue(config.max_batch_items, config.max_batch_tokens)
        self.inflight: dict[str, _Job] = {}  # mm_hash -> its encode, from admission to result
        self._init_pools()
        self._queued: set[_Job] = set()  # admitted, not yet in the tower
        self._running = 0
        self._activity = _Activity()
        self._ready = asyncio.Event()  # the queue is not empty
        self._added = asyncio.Event()  # an item joined the queue (ends a batch wait early)
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    def _init_pools(self) -> None:
        workers = self.config.preprocess_workers or min(os.cpu_count() or 1, 8)
        self._prep_pool = ThreadPoolExecutor(workers, thread_name_prefix="encoder-prep")
        # NOTE: one thread: batches run one at a time, and CUDA work stays on one thread.
        self._tower_pool = ThreadPoolExecutor(1, thread_name_prefix="encoder-tower")

    def start(self) -> None:
        """Start the batch loop (in the running event loop)."""
        assert self._loop_task is None, "already started"
        self._loop_task = asyncio.create_task(self._batch_loop(), name="encoder-batches")

    async def close(self) -> None:
        """Stop the batch loop and drop what is left (the server drains calls first)."""
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None
        self._prep_pool.shutdown(wait=False, cancel_futures=True)
        self._tower_pool.shutdown(wait=False, cancel_futures=True)

    def load(self) -> EncoderLoad:
        per_second, busy = self._activity.rates()
        return EncoderLoad(
            queued_items=len(self._queued),
            queued_tokens=sum(j.num_tokens for j in self._queued),
            running_items=self._running,
            items_per_second=per_second,
            busy_fraction=busy,
            batch_items=self._activity.mean_batch(),
        )

    # -- one call ------------------------------------------------------------------------------

    async def execute_mm_encoder(self, items: Sequence[EncodeItem]) -> list[ItemResult]:
        """Encode and publish `items`; one result per item, in order. With nothing scheduled it
        does nothing at all (no Redis round trip, no tower)."""
        if not items:
            return []
        started = time.monotonic()
        results: list[ItemResult | None] = [None] * len(items)
        first: dict[str, int] = {}  # mm_hash -> its first index in this call
        waits: dict[str, asyncio.Future[ItemResult]] = {}
        joined: set[str] = set()  # hashes another call is encoding
        unknown: list[str] = []
        for i, item in enumerate(items):
            problem = self._check(item)
            if problem is not None:
                results[i] = ItemResult.failed(item.mm_hash, "invalid_argument", problem, 0.0)
                self.metrics.error["invalid_argument"].inc()
            elif item.mm_hash not in first:
                first[item.mm_hash] = i
                if self._join(item.mm_hash, waits):
                    joined.add(item.mm_hash)
                else:
                    unknown.append(item.mm_hash)
        if unknown:
            answered, missing = await self._skip_held(unknown, started)
            for h, result in answered.items():
                results[first[h]] = result
            new: list[EncodeItem] = []
            for h in missing:
                if self._join(h, waits):  # another call admitted it while we asked
                    joined.add(h)
                else:
                    new.append(items[first[h]])
            if new:
                waits.update(self._admit(new))
        if waits:
            # NOTE: wait, never gather: a cancelled call must not cancel encodes that other
            # calls share (and that are worth publishing anyway).
            await asyncio.wait(waits.values())
        self.metrics.items_deduplicated.inc(len(joined))
        for h, done in waits.items():
            result = done.result()
            if h in joined and result.outcome == "stored":
                result = replace(result, outcome="held", nbytes=0)
                self.metrics.items_held.inc()
            results[first[h]] = replace(result, encode_seconds=time.monotonic() - started)
        for i, item in enumerate(items):
            if results[i] is None:  # a repeat of an earlier item of this call
                results[i] = results[first[item.mm_hash]]
        return results  # type: ignore[return-value]

    def _check(self, item: EncodeItem) -> str | None:
        """Why the item cannot be taken at all (before any work), or None."""
        try:
            self.connector.sync.key(item.mm_hash)
        except ValueError as e:
            return f"bad mm_hash: {e}"
        return None

    async def _skip_held(
        self, hashes: list[str], started: float
    ) -> tuple[dict[str, ItemResult], list[str]]:
        """One round trip for the call, before any preprocessing -> (results of the hashes the
        cache holds, or of all of them when Redis cannot answer; the hashes it lacks)."""
        checked = tracing.now_ns()
        try:
            held = await self.connector.has_many(hashes)
        except ConnectorError as e:
            seconds = time.monotonic() - started
            self.metrics.error["unavailable"].inc(len(hashes))
            return {h: ItemResult.failed(h, "unavailable", str(e), seconds) for h in hashes}, []
        seconds = time.monotonic() - started
        check = Stages()
        check.add("held_check", checked, items=len(hashes), held=sum(held))
        self.metrics.stages.observe(check)
        pairs = zip(hashes, held, strict=True)
        answered = {
            h: ItemResult(h, "held", encode_seconds=seconds, stages=tuple(check))
            for h, ok in pairs
            if ok
        }
        self.metrics.items_held.inc(len(answered))
        return answered, [h for h in hashes if h not in answered]

    def _join(self, mm_hash: str, waits: dict[str, asyncio.Future]) -> bool:
        job = self.inflight.get(mm_hash)
        if job is None:
            return False
        waits[mm_hash] = job.done
        return True

    def _admit(self, items: list[EncodeItem]) -> dict[str, asyncio.Future[ItemResult]]:
        loop = asyncio.get_running_loop()
        jobs = [_Job(item, loop.create_future()) for item in items]
        for job in jobs:
            self.inflight[job.mm_hash] = job
            self._queued.add(job)
        self._spawn(self._prepare(jobs))
        return {job.mm_hash: job.done for job in jobs}

    # -- stages --------------------------------------------------------------------------------

    async def _prepare(self, jobs: list[_Job]) -> None:
        """Preprocess one call's new items in parallel, then queue them together.

        NOTE: together, not each as soon as it is ready: the call answers once all its items
        are published, so running its first item early gains nothing, while queueing them as
        one lets them share a forward even when the tower is idle."""
        loop = asyncio.get_running_loop()
        outputs = await asyncio.gather(
            *(loop.run_in_executor(self._prep_pool, self._preprocess, job) for job in jobs),
            return_exceptions=True,
        )
        for job, out in zip(jobs, outputs, strict=True):
            if isinstance(out, MediaError):
                self._finish(job, ItemResult.failed(job.mm_hash, "invalid_argument", out.reason, 0))
            elif isinstance(out, BaseException):  # a bug in preprocessing: this item alone
                logger.error("preprocessing %s failed", job.mm_hash, exc_info=out)
                message = f"preprocessing failed: {out}"
                self._finish(job, ItemResult.failed(job.mm_hash, "internal", message, 0.0))
            else:
                job.processed = out
                job.queued = tracing.now_ns()
                self.queue.add(job)
        if self.queue:
            self._ready.set()
            self._added.set()

    def _preprocess(self, job: _Job) -> ProcessedMedia:
        """In a preprocessing thread: the header first (so GetLoad counts its tokens), then
        decoding and preprocessing."""
        started = time.perf_counter()
        with job.stages.time(
            "preprocess", mm_hash=job.mm_hash, modality=job.media.modality
        ) as stage:
            job.num_tokens = self.tower.grid(job.media).encoder_tokens
            stage.attributes["tokens"] = job.num_tokens
            processed = self.tower.prepare(job.media)
        self.metrics.preprocess_seconds.observe(time.perf_counter() - started)
        return processed

    async def _batch_loop(self) -> None:
        while True:
            await self._ready.wait()
            await self._wait_to_fill()
            batch = self.queue.schedule()
            if not self.queue:
                self._ready.clear()
            if not batch:
                continue
            try:
                await self._run_batch(batch)
            except Exception as e:  # never let the loop die: every later call would hang
                logger.exception("batch of %d failed outside the tower", len(batch))
                for job in batch:
                    if not job.done.done():
                        failed = ItemResult.failed(job.mm_hash, "internal", str(e), 0.0)
                        self._finish(job, failed)

    async def _wait_to_fill(self) -> None:
        """Up to batch_wait_ms for a batch that is not full yet to fill (0: not at all)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.batch_wait_ms / 1000
        while not self.queue.full() and (remaining := deadline - loop.time()) > 0:
            self._added.clear()
            try:
                await asyncio.wait_for(self._added.wait(), remaining)
            except TimeoutError:
                return

    async def _run_batch(self, batch: list[_Job]) -> None:
        """The tower over one batch, then a put per item (the next batch need not wait)."""
        for job in batch:
            self._queued.discard(job)
            job.running = True
        self._running += len(batch)
        inputs = [job.processed for job in batch]
        for job in batch:
            job.processed = None  # the batch holds the pixels now; freed after the forward
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        began = tracing.now_ns()
        self._activity.begin()
        try:
            outputs = await loop.run_in_executor(self._tower_pool, self._forward, inputs)
        finally:
            self._activity.end(len(batch))
        ended = tracing.now_ns()
        tokens = sum(p.grid.encoder_tokens for p in inputs)
        for job in batch:
            job.stages.add("queue_wait", job.queued, began, mm_hash=job.mm_hash)
            job.stages.add(
                "tower",
                began,
                ended,
                mm_hash=job.mm_hash,
                batch_items=len(batch),
                batch_tokens=tokens,
            )
        m = self.metrics
        m.tower_seconds.observe(time.perf_counter() - started)
        m.batch_items.observe(len(batch))
        m.batch_tokens.observe(tokens)
        for job, out in zip(batch, outputs, strict=True):
            if isinstance(out, torch.Tensor):
                m.items_encoded.inc()
                self._spawn(self._publish(job, out))
            else:
                message = f"the vision tower failed: {out}"
                self._finish(job, ItemResult.failed(job.mm_hash, "internal", message, 0.0))

    def _forward(self, inputs: list[ProcessedMedia]) -> list[torch.Tensor | Exception]:
        """In the tower thread. A batch that fails is retried item by item, so that one item
        that breaks the tower (or runs it out of memory) fails alone."""
        try:
            return list(self.tower.run(inputs))
        except Exception as e:
            if len(inputs) == 1:
                logger.exception("the vision tower failed on one item")
                return [e]
            logger.warning("the tower failed on a batch of %d (%s); one by one", len(inputs), e)
        outputs: list[torch.Tensor | Exception] = []
        for item in inputs:
            try:
                outputs.extend(self.tower.run([item]))
            except Exception as e:
                logger.exception("the vision tower failed on one item")
                outputs.append(e)
        return outputs

    async def _publish(self, job: _Job, embeds: torch.Tensor) -> None:
        """Set-if-absent with TTL; losing the race to another encoder is HELD, not an error."""
        num, width = embeds.shape[0], embeds.shape[-1]
        began = tracing.now_ns()
        try:
            put = await self.connector.put(job.mm_hash, embeds)
        except ConnectorError as e:
            job.stages.add("publish", began, mm_hash=job.mm_hash, error=str(e))
            self._finish(job, ItemResult.failed(job.mm_hash, "unavailable", str(e), 0.0))
            return
        job.stages.add("publish", began, mm_hash=job.mm_hash, stored=put.stored, bytes=put.nbytes)
        if put.stored:
            self.metrics.bytes_published.inc(put.nbytes)
        else:
            self.metrics.items_held.inc()
        outcome: Outcome = "stored" if put.stored else "held"
        nbytes = put.nbytes if put.stored else 0
        self._finish(job, ItemResult(job.mm_hash, outcome, num, width, embeds.dtype, nbytes))

    def _finish(self, job: _Job, result: ItemResult) -> None:
        if job.done.done():  # already failed by the batch loop's guard
            return
        if self.inflight.get(job.mm_hash) is job:
            del self.inflight[job.mm_hash]
        self._queued.discard(job)
        if job.running:
            job.running = False
            self._running -= 1
        seconds = time.monotonic() - job.accepted
        if result.outcome == "failed":
            self.metrics.error[result.error_kind].inc()
        else:
            self.metrics.encode_seconds.observe(seconds)
        self.metrics.stages.observe(job.stages)
        job.done.set_result(replace(result, encode_seconds=seconds, stages=tuple(job.stages)))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
