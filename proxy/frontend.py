"""One request through the cluster, for both APIs:

    has_many(all items)                       one round trip; held items go to no encoder;
                                              a store not answering fails the request (503)
    submit(missing items)                     single flight, split over encoders by load
    LM Generate, sent at once                 the LM worker waits (notified) for embeddings
      <- tokens stream back                   re-encode what it reports missing, continue
      <- a dead LM before any output          retried on another one

NOTE: the LM request goes out as soon as the prompt is ready instead of after the encodes:
the LM worker's wait is woken by the connector's publish the moment the last embedding lands,
so the request costs no extra round trip through the proxy, and a held image no wait at all.
The LM worker admits the request at once and prefills the text before its first missing item
while that item is encoded (`lm.overlap_encode_prefill`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import grpc

from common import tracing
from connector import AsyncECConnector, ConnectorError, StoreUnavailable
from proto import epd_pb2
from proxy.affinity import Affinity, PromptChains
from proxy.encode import RETRYABLE, EncodeDispatcher, Unavailable, backoff
from proxy.metrics import ProxyMetrics
from proxy.pd import PREFILL, PDRouter
from proxy.prepare import BadInput, PreparedRequest
from proxy.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

# How long a finished request waits for its encodes' answers to complete its usage counts.
USAGE_WAIT_SECONDS = 2.0


class CallLost(Exception):
    """A call cancelled from outside this request (its channel closed): retryable."""

    def __init__(self, address: str):
        super().__init__(address)
        self.address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"the connection to LM worker {self.address} was closed"


@dataclass
class _Running:
    """A request in the frontend: its LM call now (its own id, the worker), and whether a
    client aborted it."""

    owner: str  # who may abort it (PreparedRequest.owner)
    call: tuple[str, Worker] | None = None
    aborted: bool = False


@dataclass
class Chunk:
    """What the frontend streams to either API: a token delta, and on the last one the rest."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)  # epd_pb2.TokenLogprobs
    finish_reason: int = epd_pb2.FINISH_REASON_UNSPECIFIED
    usage: epd_pb2.Usage | None = None
    timings: epd_pb2.StageTimings | None = None
    rope_delta: int | None = None  # a prefill stage's position state, for its decode stage


class Frontend:
    def __init__(
        self,
        connector: AsyncECConnector,
        encoders: WorkerPool,
        lms: WorkerPool,
        metrics: ProxyMetrics,
        retries: int,
        encode_timeout: float,
        mark_ttl: float,
        affinity: Affinity | None = None,
    ):
        self.connector = connector
        self.encoders = encoders
        self.lms = lms
        self.metrics = metrics
        self.retries = retries
        self.dispatcher = EncodeDispatcher(encoders, metrics, retries, connector, mark_ttl)
        self.pd = PDRouter(lms, affinity)
        self.encode_timeout = encode_timeout
        # Client request id -> the requests running under it. Clients' ids may collide; each
        # LM call gets a unique id, so every one of them stays abortable.
        self.running: dict[str, list[_Running]] = {}

    async def abort(self, request_id: str, owner: str) -> bool:
        """Abort `owner`'s running requests of that id (another caller's of the same id run
        on); their streams end with FINISH_REASON_ABORT. False: `owner` runs none."""
        if not owner:  # "" owns nothing abortable (HTTP requests)
            return False
        requests = [r for r in self.running.get(request_id, ()) if r.owner == owner]
        for running in requests:
            running.aborted = True  # a request between two LM calls (migrating) stops too
            if running.call is not None:
                lm_id, worker = running.call
                await worker.stub.Abort(epd_pb2.AbortRequest(request_id=lm_id), timeout=5)
        return bool(requests)

    async def generate(self, req: PreparedRequest, deadline: float) -> AsyncIterator[Chunk]:
        usage = epd_pb2.Usage(mm_items=len(req.items))
        timings = epd_pb2.StageTimings(preprocess_seconds=req.preprocess_seconds)
        encodes: list[asyncio.Future] = []
        encode_stage = None
        if req.items:
            started = time.perf_counter()
            checked = tracing.now_ns()
            hashes = [i.mm_hash for i in req.items]
            try:
                held = await self.connector.has_many(hashes)
            except StoreUnavailable as e:
                # Embeddings reach the LM workers only through the store: no way around it.
                raise Unavailable(str(e)) from None
            except ConnectorError as e:
                # Without the cache's answer every item is encoded; encoders skip what is held.
                logger.warning("has_many failed (%s): encoding every item", e)
                held = [False] * len(hashes)
            timings.cache_lookup_seconds = time.perf_counter() - started
            missing = [i for i, h in zip(req.items, held, strict=True) if not h]
            req.stages.add("cache_check", checked, items=len(hashes), held=sum(held))
            self._count(usage, "held", len(req.items) - len(missing))
            if missing:
                encode_stage = req.stages.begin("encode", req.span, items=len(missing))
                encodes, joined = self.dispatcher.submit(
                    missing, self._encode_deadline(), encode_stage.span
                )
                encode_stage.attributes["deduplicated"] = sum(joined)
                self._count(usage, "deduplicated", sum(joined))
                for future, was_joined in zip(encodes, joined, strict=True):
                    future.add_done_callback(_consume)  # retrieved even if this request ends
                    if not was_joined:
                        future.add_done_callback(partial(self._count_outcome, usage))
        encode_started = time.perf_counter()
        if encodes:
            encode_watch = asyncio.ensure_future(
                self._encodes_done(encodes, timings, encode_started, req.stages, encode_stage)
            )
        else:  # nothing to wait for: the relay below takes its direct path
            encode_watch = asyncio.get_running_loop().create_future()
            encode_watch.set_result(None)
        try:
            async for chunk in self._stream_lm(req, deadline, encode_watch):
                if chunk.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                    if not encode_watch.done():
                        # The LM finished on the published embeddings; the encoders' own
                        # answers, which this request's usage counts, arrive right behind.
                        await asyncio.wait({encode_watch}, timeout=USAGE_WAIT_SECONDS)
                    chunk.usage.MergeFrom(usage)
                    chunk.timings.MergeFrom(timings)
                yield chunk
        finally:
            encode_watch.cancel()

    def _encode_deadline(self) -> float:
        return time.monotonic() + self.encode_timeout

    def _count(self, usage: epd_pb2.Usage, result: str, n: int) -> None:
        """One place counts media items, for the request's usage and for the metrics."""
        if n:
            field = f"mm_items_{result}"  # held | encoded | deduplicated
            setattr(usage, field, getattr(usage, field) + n)
            self.metrics.mm_items.labels(result).inc(n)

    def _count_outcome(self, usage: epd_pb2.Usage, future: asyncio.Future) -> None:
        """An encode this request dispatched: stored (encoded) or, when another encoder or
        request published it meanwhile, held (no tower work ran)."""
        if future.cancelled() or future.exception() is not None:
            return
        held = future.result().outcome == epd_pb2.ENCODE_OUTCOME_HELD
        self._count(usage, "held" if held else "encoded", 1)

    async def _encodes_done(
        self, encodes, timings: epd_pb2.StageTimings, started: float, stages, stage
    ) -> None:
        """Raises the first encode failure (the request is answered with it). The futures are
        shared with every request that joined the same encode: shielded, so that this request
        ending (and this watch being cancelled) leaves them to the others."""
        done = False
        try:
            await asyncio.gather(*(asyncio.shield(f) for f in encodes))
            timings.encode_seconds = time.perf_counter() - started
            done = True
        finally:
            stages.finish(stage, done=done)

    def _lm_message(self, req: PreparedRequest, lm_id: str, sent: list[int], sent_chars: int):
        """The LM request: the prompt, and after a migration the tokens already sent appended
        to it (their KV is recomputed on the new worker; max_tokens counts what is left), with
        how much of their text the client has: the new worker continues the sampling draws and
        holds back the rest of that text for its stop-string watch, as the old one did."""
        msg = req.lm_request()
        msg.request_id = lm_id
        if sent:
            msg.prompt_token_ids.extend(sent)
            msg.resumed_output_tokens = len(sent)
            msg.resumed_text_chars = sent_chars
            if req.sampling.HasField("max_tokens"):
                msg.sampling.max_tokens = req.sampling.max_tokens - len(sent)
        return msg

    async def _stream_lm(
        self, req: PreparedRequest, deadline: float, encode_watch: asyncio.Future
    ) -> AsyncIterator[Chunk]:
        """The LM's chunks. A call that fails for the worker's sake (it died, froze, was cut
        off) before any output is retried on another worker; after some output the request
        migrates: another worker continues from the prompt plus the tokens already sent, and
        the client's stream goes on with no token repeated or skipped: greedy and seeded
        requests continue token-identically, and a stop string spanning the cut still stops
        it."""
        running = _Running(req.owner)
        self.running.setdefault(req.request_id, []).append(running)
        try:
            async for chunk in self._attempts(req, deadline, encode_watch, running):
                yield chunk
        finally:
            same_id = self.running.get(req.request_id, [])
            same_id.remove(running)
            if not same_id:
                self.running.pop(req.request_id, None)

    def _choose_lm(self, stage, tried, target, chains) -> Worker | None:
        """The LM worker for this attempt: the stage's (prefill / decode split), else one not
        tried yet, else any usable one."""
        worker = self.pd.pick(stage, tried, target, chains) if stage else None
        return worker or self.pd.pick_any(tried, chains) or self.lms.pick()

    async def _attempts(self, req, deadline, encode_watch, running) -> AsyncIterator[Chunk]:
        sent: list[int] = []  # output token ids the client has been sent
        sent_chars = 0  # characters of text the client has been sent
        tried: set[str] = set()
        attempt = -1
        target = None  # the decode worker a prefill stage sent its KV to (direct KV)
        chains = PromptChains(req.prompt_token_ids, req.items)  # prefix affinity's keys
        rope_delta = None  # the prefill stage's, carried by the decode stage (and its retries)
        while attempt + 1 < self.retries:
            attempt += 1
            if running.aborted:  # aborted while it migrated
                usage = epd_pb2.Usage(
                    prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(sent)
                )
                finish = epd_pb2.FINISH_REASON_ABORT
                yield Chunk(finish_reason=finish, usage=usage, timings=epd_pb2.StageTimings())
                return
            lm_id = f"{req.request_id}@{uuid.uuid4().hex[:12]}"
            msg = self._lm_message(req, lm_id, sent, sent_chars)
            if rope_delta is not None:
                msg.rope_delta = rope_delta
            stage = self.pd.stage(msg, sent)  # prefill / decode split (proxy/pd.py)
            choose = partial(self._choose_lm, stage, tried, target, chains)
            worker = await self.lms.wait_for(choose, min(deadline - time.monotonic(), 2.0))
            if worker is None:
                raise Unavailable("no LM worker is available")
            tried.add(worker.address)
            if stage == PREFILL:
                target = self.pd.cap(msg, chains)
            carried = len(sent)  # output tokens this call takes as prompt
            if msg.sampling.HasField("max_tokens") and msg.sampling.max_tokens < 1:
                usage = epd_pb2.Usage(
                    prompt_tokens=len(req.prompt_token_ids), completion_tokens=carried
                )
                finish = epd_pb2.FINISH_REASON_LENGTH
                yield Chunk(finish_reason=finish, usage=usage, timings=epd_pb2.StageTimings())
                return
            tokens = len(msg.prompt_token_ids)
            worker.sent(tokens)
            running.call = (lm_id, worker)
            lm_stage = req.stages.begin(
                "lm_call",
                req.span,
                worker=worker.address,
                attempt=attempt,
                stage=stage or "both",
                prompt_tokens=tokens,
                resumed_tokens=carried,
            )
            call = worker.stub.Generate(
                msg,
                timeout=max(deadline - time.monotonic(), 0.01),
                metadata=tracing.tracer().metadata(lm_stage.span),
            )
            handed_over = False
            try:
                async for chunk in self._relay(call, req, deadline, encode_watch):
                    if stage == PREFILL and self.pd.handed_over(worker, msg, chunk.finish_reason):
                        # The first token goes out now; a decode worker streams the rest.
                        handed_over = True
                        rope_delta = chunk.rope_delta
                        chunk.finish_reason = epd_pb2.FINISH_REASON_UNSPECIFIED
                        chunk.usage = chunk.timings = None
                    sent.extend(chunk.token_ids)
                    sent_chars += len(chunk.text)
                    if carried and chunk.usage is not None:  # counted as the client sees it
                        chunk.usage.prompt_tokens -= carried
                        chunk.usage.completion_tokens += carried
                    yield chunk
                self.lms.succeeded(worker)
                self.pd.record(worker, chains)
                if not handed_over:
                    return
                self.metrics.handovers.inc()
                attempt, tried = -1, set()  # the decode stage has its own retries
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError):
                    if asyncio.current_task().cancelling():
                        raise  # the client went away: stop here
                    # The call was cancelled under us: its worker's channel was closed.
                    e = CallLost(worker.address)
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise BadInput(e.details()) from None
                # The client's own deadline passing is no fault of the worker's.
                expired = code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline
                if code in RETRYABLE and not expired:
                    self.lms.failed(worker, f"Generate: {code.name}: {e.details()}")
                if expired or code not in RETRYABLE or attempt + 1 >= self.retries:
                    if isinstance(e, CallLost):
                        raise Unavailable(e.details()) from None
                    raise
                if sent:
                    self.metrics.migrations.inc()
                    logger.warning(
                        "%s: LM worker %s failed after %d tokens (%s): migrating",
                        req.request_id,
                        worker.address,
                        len(sent),
                        code.name,
                    )
                else:
                    self.metrics.retries.labels("lm").inc()
                await asyncio.sleep(backoff(attempt))
            finally:
                worker.finished(tokens, generated=len(sent) - carried)
                req.stages.finish(lm_stage, output_tokens=len(sent) - carried)
                running.call = None
                call.cancel()  # no-op when finished; aborts the LM request otherwise

    async def _relay(self, call, req: PreparedRequest, deadline: float, encode_watch):
        """LM responses as Chunks; re-encodes what the LM reports missing; an encode failure
        ends the request with it."""
        if encode_watch.done() and encode_watch.exception() is None:
            # Nothing to watch (no encodes, or all done): relay straight through.
            async for msg in call:
                if msg.missing_mm_hashes:
                    await self._reencode(req, list(msg.missing_mm_hashes), deadline)
                    continue
                yield _chunk(msg)
            return
        stream = call.__aiter__()
        while True:
            if encode_watch.done() and encode_watch.exception() is not None:
                raise encode_watch.exception()  # (it may have failed while we handled a miss)
            next_msg = asyncio.ensure_future(stream.__anext__())
            waiting = {next_msg} if encode_watch.done() else {next_msg, encode_watch}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if encode_watch in done and encode_watch.exception() is not None:
                next_msg.cancel()
                raise encode_watch.exception()
            try:
                msg = await next_msg
            except StopAsyncIteration:
                return
            if msg.missing_mm_hashes:
                await self._reencode(req, list(msg.missing_mm_hashes), deadline)
                continue
            yield _chunk(msg)

    async def _reencode(self, req: PreparedRequest, hashes: list[str], deadline: float) -> None:
        """The LM worker cannot find these: encode them again unless an encode is in flight
        or they were published meanwhile."""
        candidates = [h for h in hashes if h not in self.dispatcher.inflight]
        if not candidates:
            return
        try:
            held = await self.connector.has_many(candidates)
        except ConnectorError:
            held = [False] * len(candidates)
        lost = [req.item(h) for h, ok in zip(candidates, held, strict=True) if not ok]
        if lost:
            logger.info(
                "%s: re-encoding %d items the LM worker found missing", req.request_id, len(lost)
            )
            self.metrics.reencodes.inc(len(lost))
            futures, _ = self.dispatcher.submit(lost, self._encode_deadline())
            for f in futures:  # failures surface through the LM's wait timing out
                f.add_done_callback(_consume)


def _chunk(msg: epd_pb2.LMGenerateResponse) -> Chunk:
    chunk = Chunk(
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=list(msg.logprobs),
        finish_reason=msg.finish_reason,
    )
    if msg.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
        chunk.usage = epd_pb2.Usage()
        chunk.usage.CopyFrom(msg.usage)
        chunk.timings = epd_pb2.StageTimings()
        chunk.timings.CopyFrom(msg.timings)
        if msg.HasField("rope_delta"):
            chunk.rope_delta = msg.rope_delta
    return chunk


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
