"""The LM worker: the `LanguageModel` gRPC service over the engine (lm_worker/engine.py).

Per Generate call: check and convert the request (protobuf stops here) -> hand it to the
engine at once, which prefills it up to its first item whose embedding is not in yet, while its
embeddings are fetched from the EC connector as they appear (notified, bounded; misses are
reported on the stream so the proxy can re-encode) and fed to the engine -> stream its outputs
back. With `lm.overlap_encode_prefill` off, the request waits for all its embeddings before
the engine sees it. A client that goes away aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial

import grpc
import numpy as np

from common.config import ClusterConfig, parse_address
from common.media import MODALITY_NAMES
from common.served_model import resolve_model
from common.server import RoleServer, Service, run_worker
from common.tls import cluster_server_credentials
from connector import AsyncECConnector, ConnectorError, wait_until_reachable
from connector.kv import KVStore, peek_key
from connector.kv_stream import KVInbox, KVReceiver, KVSender
from connector.registry import Heartbeat
from connector.streams import SessionStreams
from lm_worker.engine import BadRequest, LMEngine, RequestOutput, deliver
from lm_worker.loader import build_engine
from lm_worker.realtime import RealtimeFeeder, TooManySessions
from lm_worker.request import Request
from models import EmbeddingMismatch, LoadedEmbedding, MMFeature, SamplingParams
from proto import epd_pb2, epd_pb2_grpc

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": epd_pb2.FINISH_REASON_STOP,
    "length": epd_pb2.FINISH_REASON_LENGTH,
    "abort": epd_pb2.FINISH_REASON_ABORT,
}


def to_request(msg: epd_pb2.LMGenerateRequest) -> Request:
    """The engine's Request for a LMGenerateRequest (protobuf stops here); BadRequest for what
    the message itself gets wrong. What the engine cannot run is its `validate`'s to say."""
    ids = list(msg.prompt_token_ids)
    features = []
    end = 0
    for f in msg.mm_features:
        if not f.mm_hash:
            raise BadRequest("an mm_feature has no mm_hash")
        # Whether placeholders may run past the prompt (realtime models) is the engine's call.
        if f.offset < end or f.offset >= len(ids) or f.length == 0:
            raise BadRequest(
                f"mm_feature {f.mm_hash}: placeholders [{f.offset}, {f.offset + f.length}) "
                f"overlap another item or start outside the {len(ids)}-token prompt"
            )
        if f.is_embed and len(f.is_embed) != f.length:
            raise BadRequest(
                f"mm_feature {f.mm_hash}: is_embed has {len(f.is_embed)} flags for "
                f"{f.length} placeholders"
            )
        grid = (f.grid.t, f.grid.h, f.grid.w) if f.HasField("grid") else None
        features.append(
            MMFeature(
                mm_hash=f.mm_hash,
                offset=f.offset,
                length=f.length,
                is_embed=np.asarray(f.is_embed, dtype=bool) if f.is_embed else None,
                modality=MODALITY_NAMES.get(f.modality, "image"),
                grid_thw=grid,
                second_per_grid_t=f.second_per_grid_t or None,
            )
        )
        end = f.offset + f.length
    s = msg.sampling
    try:
        sampling = SamplingParams(
            max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if msg.resumed_output_tokens > len(ids):
        raise BadRequest(
            f"resumed_output_tokens {msg.resumed_output_tokens} is more than the "
            f"{len(ids)}-token prompt"
        )
    return Request(
        request_id=msg.request_id or f"lm-{uuid.uuid4().hex[:16]}",
        prompt_token_ids=ids,
        sampling=sampling,
        mm_features=features,
        resumed_output_tokens=msg.resumed_output_tokens,
        resumed_text_chars=msg.resumed_text_chars,
    )


def to_response(out: RequestOutput) -> epd_pb2.LMGenerateResponse:
    msg = epd_pb2.LMGenerateResponse(token_ids=out.token_ids, text=out.text)
    for t in out.logprobs:
        entry = msg.logprobs.add(logprob=t.logprob or 0.0)
        for token_id, logprob in t.top or ():
            entry.top.add(token_id=token_id, logprob=logprob)
    if out.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS.get(out.finish_reason, epd_pb2.FINISH_REASON_STOP)
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_prompt_tokens = out.num_cached_tokens
        for key, value in out.timings.items():
            setattr(msg.timings, key, value)
    return msg


class EmbeddingFetcher:
    """Waits for a request's embeddings in the connector and brings them to the device."""

    def __init__(self, connector: AsyncECConnector, engine: LMEngine, timeout: float):
        self.connector = connector
        self.engine = engine
        self.timeout = timeout
        self.waiting = 0  # requests waiting for embeddings (GetLoad)

    async def fetch(self, request: Request, report, deliver=None) -> dict[str, LoadedEmbedding]:
        """{mm_hash: tensor on the engine's device}. `report(hashes)` is awaited with each
        set of hashes newly found missing; `deliver(found)`, when given, is called with each
        set as it is fetched. Raises TimeoutError after `timeout` seconds."""
        # A realtime session's rows come through its stream (lm_worker/realtime.py).
        needed = {
            f.mm_hash: f.num_embeds
            for f in request.mm_features
            if f.mm_hash != request.realtime_session
        }
        found: dict[str, LoadedEmbedding] = {}
        reported: set[str] = set()
        deadline = time.monotonic() + self.timeout
        self.waiting += 1
        try:
            while True:
                pending = [h for h in needed if h not in found]
                fetched, misses = await self.connector.get_many(pending)
                loaded = {}
                for h, tensor in fetched.items():
                    loaded[h] = await asyncio.to_thread(
                        self.engine.load_embedding, h, tensor, needed[h]
                    )
                found.update(loaded)
                if deliver is not None and loaded:
                    deliver(loaded)
                if not misses:
                    return found
                new = [h for h in misses if h not in reported]
                if new:
                    self.engine.metrics.embedding_misses.inc(len(new))
                    reported.update(new)
                    await report(new)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or await self.connector.wait_for(misses, remaining):
                    raise TimeoutError(
                        f"embeddings {sorted(set(misses))} did not arrive within "
                        f"{self.timeout:.0f}s"
                    )
                # Everything arrived: an item missing on the next read was evicted again, a
                # new miss, reported again (else it would wait out the whole timeout).
                reported.clear()
        finally:
            self.waiting -= 1


class _Active:
    """A Generate call in flight: its output queue, its embedding wait, whether it is aborted
    and whether the engine has it."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.fetch: asyncio.Future | None = None
        self.aborted = False
        self.in_engine = False
        self.embedding_wait: float | None = None  # seconds until every embedding was in


@dataclass
class _FetchFailed:
    """Put on a request's output queue when its embeddings cannot be had (overlap: the
    request is already in the engine): the status its stream ends with."""

    code: grpc.StatusCode
    message: str


def _fetch_status(e: BaseException) -> grpc.StatusCode | None:
    """The status a failed embedding fetch ends its stream with (None: not a fetch error)."""
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(e, EmbeddingMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, ConnectorError):
        return grpc.StatusCode.UNAVAILABLE
    return None


class LanguageModelServicer(epd_pb2_grpc.LanguageModelServicer):
    def __init__(self, config: ClusterConfig, name: str):
        self.config = config
        self.name = name
        self.role: RoleServer | None = None
        self.engine: LMEngine | None = None
        self.fetcher: EmbeddingFetcher | None = None
        self.connector: AsyncECConnector | None = None
        self.streams: SessionStreams | None = None
        self.feeder: RealtimeFeeder | None = None
        self.active: dict[str, _Active] = {}
        self.kv_receiver: KVReceiver | None = None  # the direct KV path's listener
        self.kv_address = ""
        self.stuck = False
        self._watchdog: asyncio.Task | None = None

    async def load(self) -> None:
        """Model, KV cache, graphs and a warm-up step, then the connector."""
        c = self.config
        await wait_until_reachable(
            c.connector.redis_url, c.connector.startup_wait_seconds, c.connector.mode
        )
        served = await asyncio.to_thread(resolve_model, c)
        loop = asyncio.get_running_loop()

        def emit(items):
            loop.call_soon_threadsafe(deliver, items)

        kv_store = kv_direct = None
        if c.lm.kv_tier in ("shared", "direct"):
            options = c.connector.connector_options()
            kv_store = KVStore(
                options["url"],
                served.fingerprint,
                namespace=options["namespace"],
                ttl_seconds=c.lm.kv_ttl_seconds,
                op_timeout=options["op_timeout"],
                retries=options["retries"],
                mode=options["mode"],
            )
        if c.lm.kv_tier == "direct":
            inbox = KVInbox(c.lm.kv_inbox_bytes)
            host = parse_address(c.lm.listen, "listen")[0]
            self.kv_receiver = KVReceiver(host, c.lm.kv_port, inbox, peek_key)
            advertised = parse_address(c.lm.address, "advertise")[0]
            if ":" in advertised:
                advertised = f"[{advertised}]"
            self.kv_address = f"{advertised}:{self.kv_receiver.port}"
            kv_direct = (KVSender(c.connector.op_timeout_seconds), inbox)
        self.engine = await asyncio.to_thread(
            build_engine,
            c.lm,
            served.family,
            served.dtype,
            emit,
            kv_store=kv_store,
            kv_direct=kv_direct,
        )
        self.engine.start()
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint, **c.connector.connector_options(local_tier=True)
        )
        self.fetcher = EmbeddingFetcher(self.connector, self.engine, c.lm.embedding_timeout_seconds)
        options = c.connector.connector_options()
        options.pop("local_tier_bytes")
        self.streams = SessionStreams(**options)
        self.feeder = RealtimeFeeder(self.streams, self.engine, c.lm.max_realtime_sessions)
        self._watchdog = asyncio.create_task(self.watch_steps(c.lm.step_timeout_seconds))

    async def watch_steps(self, timeout: float, every: float = 1.0) -> None:
        """A step stuck past `timeout` (the process still answers pings, so keepalive cannot
        tell): NOT_SERVING, and every stream here ends with UNAVAILABLE so the proxy migrates
        it; SERVING again once the engine moves on."""
        while True:
            await asyncio.sleep(every)
            since = self.engine.busy_since
            stuck = since is not None and time.monotonic() - since > timeout
            if stuck and not self.stuck:
                seconds = time.monotonic() - since
                logger.error(
                    "engine step stuck for %.0fs: NOT_SERVING, ending %d streams",
                    seconds,
                    len(self.active),
                )
                self.stuck = True
                await self.role.set_serving(False)
                for request_id, live in list(self.active.items()):
                    error = f"the LM worker's step has been stuck for over {timeout:.0f}s"
                    live.queue.put_nowait(
                        RequestOutput(
                            request_id, finish_reason="error", error=error, error_kind="stuck"
                        )
                    )
            elif self.stuck and not stuck and not self.role.draining:
                logger.info("engine moving again: SERVING")
                self.stuck = False
                await self.role.set_serving(True)

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
            if self.engine.kv is not None:
                await asyncio.to_thread(self.engine.kv.close)
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        if self.connector is not None:
            await self.connector.close()
        if self.streams is not None:
            await self.streams.close()

    async def Generate(self, request: epd_pb2.LMGenerateRequest, context):
        async with self.role.work(context):
            engine = self.engine
            session = request.realtime_session_id or None
            if session is not None and not engine.runner.is_realtime:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this model takes no realtime sessions (its decode steps take no audio)",
                )
            try:
                req = to_request(request)
                if session is not None:
                    self.streams.key(session)  # a usable id
                    req.realtime_session = session
                    if session not in req.mm_hashes:
                        raise BadRequest(
                            f"realtime session {session}: no mm_feature names it (its "
                            "positions, from where its audio starts)"
                        )
                    req.mm_features = [
                        dataclasses.replace(f, length=min(f.length, engine.realtime_capacity))
                        if f.mm_hash == session
                        else f
                        for f in req.mm_features
                    ]
                engine.validate(req)
            except (BadRequest, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if req.request_id in self.active:
                await context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id} is already running"
                )
            if session is not None:
                try:
                    self.feeder.reserve(session)
                except TooManySessions as e:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                except ValueError as e:
                    await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            started = time.monotonic()
            live = self.active[req.request_id] = _Active()
            queue = live.queue
            finished = False
            try:
                embeddings = {}

                async def report(hashes: list[str]) -> None:
                    await context.write(epd_pb2.LMGenerateResponse(missing_mm_hashes=hashes))

                # Media embeddings come from the connector (a realtime session's rows come
                # through its stream).
                media = any(f.mm_hash != session for f in req.mm_features)
                if engine.kv is not None:  # the blocks the KV tier holds, off the engine
                    covered = await asyncio.to_thread(
                        engine.kv.prefetch, req, request.kv_handover, request.kv_target
                    )
                    if media and session is None and covered >= req.embeds_end:
                        media = not self._media_from_kv(req, request)
                overlap = media and self.config.lm.overlap_encode_prefill
                if media and not overlap:
                    live.fetch = asyncio.ensure_future(self.fetcher.fetch(req, report))
                    try:
                        embeddings = await live.fetch
                    except asyncio.CancelledError:
                        if not live.aborted or asyncio.current_task().cancelling():
                            raise
                    except (TimeoutError, EmbeddingMismatch, ConnectorError) as e:
                        await context.abort(_fetch_status(e), str(e))
                    live.embedding_wait = time.monotonic() - started
                if live.aborted:  # aborted before the engine had it: it ends here
                    finished = True
                    await context.write(
                        to_response(
                            RequestOutput(
                                req.request_id,
                                finish_reason="abort",
                                num_prompt_tokens=req.num_prompt_tokens,
                            )
                        )
                    )
                    return
                req.arrival = time.monotonic()
                admitted = req.arrival - started  # before the engine had it
                engine.add_request(req, queue.put_nowait, embeddings, more_to_come=overlap)
                live.in_engine = True
                if overlap:
                    # The engine prefills the text before the first item while the rest is
                    # fetched (and encoded): the fetch feeds it as embeddings arrive.
                    feed = partial(engine.add_embeddings, req.request_id)
                    live.fetch = asyncio.ensure_future(self.fetcher.fetch(req, report, feed))
                    live.fetch.add_done_callback(partial(self._fetched, req.request_id, started))
                if session is not None:

                    def stream_failed(error: str, request_id: str = req.request_id) -> None:
                        queue.put_nowait(
                            RequestOutput(request_id, finish_reason="error", error=error)
                        )

                    self.feeder.start(session, stream_failed)
                while True:
                    out: RequestOutput | _FetchFailed = await queue.get()
                    if isinstance(out, _FetchFailed):
                        finished = True
                        await context.abort(out.code, out.message)
                    if out.finish_reason == "error":
                        finished = True
                        # A request that failed alone is not retried on another worker, and
                        # is not held against this one (FAILED_PRECONDITION).
                        code = {
                            "request": grpc.StatusCode.FAILED_PRECONDITION,
                            "stuck": grpc.StatusCode.UNAVAILABLE,  # migrated elsewhere
                            "moved": grpc.StatusCode.UNAVAILABLE,  # continued elsewhere
                        }.get(out.error_kind, grpc.StatusCode.INTERNAL)
                        await context.abort(code, out.error or "engine error")
                    msg = to_response(out)
                    if out.finish_reason is not None:
                        finished = True
                        if engine.kv is not None:  # a handover's blocks are all stored first
                            await wait_saves(engine.kv, req.request_id)
                        if request.kv_handover and req.rope is not None:
                            delta = engine.runner.model_state.rope_delta(req.rope)
                            if delta is not None:  # the decode stage positions with it
                                msg.rope_delta = delta
                        if live.embedding_wait is not None:
                            msg.timings.embedding_wait_seconds = live.embedding_wait
                        msg.timings.total_seconds = time.monotonic() - started
                        if "time_to_first_token_seconds" in out.timings:
                            msg.timings.time_to_first_token_seconds = (
                                out.timings["time_to_first_token_seconds"] + admitted
                            )
                    await context.write(msg)
                    if finished:
                        return
            finally:
                self.active.pop(req.request_id, None)
                if engine.kv is not None:
                    engine.kv.pending_saves(req.request_id)  # not waited for: dropped
                    if not live.in_engine:  # what its prefetch kept, the engine never took
                        engine.kv.request_finished(req.request_id)
                if live.fetch is not None:
                    live.fetch.cancel()
                if not finished and live.in_engine:  # the client went away, or its deadline
                    engine.abort(req.request_id)
                if session is not None:
                    self.feeder.stop(session)

    def _media_from_kv(self, req: Request, msg: epd_pb2.LMGenerateRequest) -> bool:
        """Every token of the request that takes a media embedding has its KV from the tier:
        position the rest with the prefill worker's rope delta and fetch no embedding (True).
        Without a delta the family can use, False: the embeddings are fetched as usual."""
        delta = msg.rope_delta if msg.HasField("rope_delta") else None
        try:
            req.rope = self.engine.runner.model_state.rope_past_media(req.num_prompt_tokens, delta)
        except ValueError:
            return False
        req.media_in_kv = True
        return True

    def _fetched(self, request_id: str, started: float, fetch: asyncio.Future) -> None:
        """An overlapped fetch ended: note its wait, or fail the request in the engine (its
        blocks freed) and end its stream with the fetch's status."""
        live = self.active.get(request_id)
        if live is None or fetch.cancelled():
            return
        e = fetch.exception()
        if e is None:
            live.embedding_wait = time.monotonic() - started
            return
        code = _fetch_status(e)
        if code is None:
            logger.error("embedding fetch for %s failed", request_id, exc_info=e)
            code = grpc.StatusCode.INTERNAL
        self.engine.fail(request_id, str(e))
        live.queue.put_nowait(_FetchFailed(code, str(e)))

    async def Abort(self, request: epd_pb2.AbortRequest, context) -> epd_pb2.AbortResponse:
        """Abort a request in any state: waiting for its embeddings (the wait is cancelled and
        its stream ends with FINISH_REASON_ABORT) or in the engine."""
        live = self.active.get(request.request_id)
        if live is None or live.aborted:
            return epd_pb2.AbortResponse(aborted=False)
        live.aborted = True
        if live.fetch is not None:
            live.fetch.cancel()
        if live.in_engine:
            self.engine.abort(request.request_id)
        return epd_pb2.AbortResponse(aborted=True)

    async def GetLoad(self, request, context) -> epd_pb2.LMLoad:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the LM worker is still loading")
        load = self.engine.load()
        blocks = self.engine.scheduler.blocks
        return epd_pb2.LMLoad(
            prefix_block_size=blocks.block_size if blocks.enable_prefix_caching else 0,
            worker_id=self.name,
            waiting_for_embeddings=self.fetcher.waiting,
            role=self.config.lm.role,
            kv_tier=self.config.lm.kv_tier,
            kv_address=self.kv_address,
            realtime_sessions=self.feeder.open,
            realtime_rows=sum(s.count for s in list(self.engine.runner.realtime.values())),
            realtime_waiting_steps=self.engine.realtime_waiting_steps,
            **load,
            **_fetches_by_tier(self.connector),
            **kv_counters(self.engine.kv),
        )


async def wait_saves(kv, request_id: str) -> None:
    """Until the request's KV writes are done. A failed write is logged, not raised: the
    blocks it held are recomputed by whoever looks for them."""
    for future in kv.pending_saves(request_id):
        try:
            await asyncio.wrap_future(future)
        except Exception as e:
            logger.warning("%s: KV save failed (%s): readers recompute", request_id, e)


def kv_counters(kv) -> dict[str, float]:
    """The KV tier's counters as LMLoad's kv_* fields (none without a tier)."""
    metrics = getattr(kv, "metrics", None)
    if metrics is None:
        return {}
    counts = {}
    for metric, label, field in (
        (metrics.bytes, "sent", "kv_bytes_sent"),
        (metrics.bytes, "received", "kv_bytes_received"),
        (metrics.blocks, "pulled", "kv_blocks_pulled"),
        (metrics.blocks, "corrupt", "kv_blocks_corrupt"),
    ):
        for sample in metric.collect()[0].samples:
            if sample.name.endswith("_total") and label in sample.labels.values():
                counts[field] = int(sample.value)
    counts["kv_send_seconds"] = sum(
        s.value
        for s in metrics.seconds.collect()[0].samples
        if s.name.endswith("_sum") and s.labels["op"] in ("save", "send")
    )
    counts["kv_transfer_p50_seconds"], counts["kv_transfer_p99_seconds"] = metrics.percentiles()
    return counts


def _fetches_by_tier(connector: AsyncECConnector) -> dict[str, int]:
    """The connector's own `get` lookup counters as LMLoad's ec_{local,redis}_{hits,misses}."""
    counts = {}
    for sample in connector.metrics.lookups.collect()[0].samples:
        labels = sample.labels
        if sample.name.endswith("_total") and labels["op"] == "get":
            result = "hits" if labels["result"] == "hit" else "misses"
            counts[f"ec_{labels['tier']}_{result}"] = int(sample.value)
    return counts


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = LanguageModelServicer(config, name)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["LanguageModel"].full_name,
        servicer,
        epd_pb2_grpc.add_LanguageModelServicer_to_server,
    )
    credentials = cluster_server_credentials(config.cluster.tls)
    server = servicer.role = RoleServer(name, config.lm.listen, [service], credentials)
    options = config.heartbeat_options("lm")
    heartbeat = Heartbeat(**options) if options else None
    return await run_worker(config.lm, server, servicer.load, servicer.close, heartbeat)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
