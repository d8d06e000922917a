"""The LM worker's gRPC edge: the `LanguageModel` service over the front end
(lm_worker/frontend.py), which runs a request's flow around the engine.

Per Generate call: convert the request (protobuf stops here) -> `LMFrontend.generate`: admit it,
attach its inputs' sources, hand it to the engine -> relay its outputs and missing-embedding
reports back. Every failure maps to a status in one function (`status_of`). A client that goes
away closes the flow, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

import grpc
import numpy as np

from common import tracing
from common.cluster_auth import required_token
from common.config import ClusterConfig, parse_address
from common.grammar import constraint_of
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
from lm_worker.frontend import (
    AlreadyRunning,
    Handover,
    LMFrontend,
    Missing,
    NotRealtime,
    RequestFailed,
)
from lm_worker.kv_connector import KVConnector
from lm_worker.loader import build_engine
from lm_worker.realtime import SessionRunning, TooManySessions
from lm_worker.request import Request
from models import EmbeddingMismatch, MMFeature, SamplingParams
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
            structured=constraint_of(s),
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
        realtime_session=msg.realtime_session_id or None,
        resumed_output_tokens=msg.resumed_output_tokens,
        resumed_text_chars=msg.resumed_text_chars,
    )


def to_response(out: RequestOutput) -> epd_pb2.LMGenerateResponse:
    msg = epd_pb2.LMGenerateResponse(token_ids=out.token_ids, text=out.text)
    for t in out.logprobs:
        entry = msg.logprobs.add(logprob=t.logprob or 0.0)
        for token_id, logprob in t.top or ():
            entry.top.add(token_id=token_id, logprob=logprob)
    if out.rope_delta is not None:
        msg.rope_delta = out.rope_delta
    if out.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS.get(out.finish_reason, epd_pb2.FINISH_REASON_STOP)
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_prompt_tokens = out.num_cached_tokens
        for key, value in out.timings.items():
            setattr(msg.timings, key, value)
    return msg


def status_of(e: BaseException) -> grpc.StatusCode | None:
    """The status a Generate call whose flow raised `e` ends with (None: not a failure of the
    request's, a bug: raised on)."""
    if isinstance(e, NotRealtime | EmbeddingMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, AlreadyRunning | SessionRunning):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, ValueError):  # BadRequest, an unusable session id
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, TooManySessions):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, TimeoutError):  # embeddings that did not arrive in time
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(e, ConnectorError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, RequestFailed):
        # A request that failed alone is not retried on another worker, and is not held
        # against this one (FAILED_PRECONDITION); a stuck step's and a moved request's are
        # continued elsewhere (UNAVAILABLE).
        return {
            "request": grpc.StatusCode.FAILED_PRECONDITION,
            "stuck": grpc.StatusCode.UNAVAILABLE,
            "moved": grpc.StatusCode.UNAVAILABLE,
        }.get(e.kind, grpc.StatusCode.INTERNAL)
    return None


class LanguageModelServicer(epd_pb2_grpc.LanguageModelServicer):
    def __init__(self, config: ClusterConfig, name: str):
        self.config = config
        self.name = name
        self.role: RoleServer | None = None
        self.engine: LMEngine | None = None
        self.frontend: LMFrontend | None = None
        self.connector: AsyncECConnector | None = None
        self.streams: SessionStreams | None = None
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
        ranks = self.engine.runner.ranks
        if ranks is not None:  # a rank gone takes the whole worker down, at once
            ranks.watch(_exit_on_lost_rank)
        self.engine.start()
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint, **c.connector.store_options(local_tier=True)
        )
        options = c.connector.connector_options()
        options.pop("local_tier_bytes")
        self.streams = SessionStreams(**options)
        self.frontend = LMFrontend(
            self.engine,
            self.connector,
            self.streams,
            embedding_timeout=c.lm.embedding_timeout_seconds,
            max_realtime_sessions=c.lm.max_realtime_sessions,
            overlap_encode_prefill=c.lm.overlap_encode_prefill,
        )
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
                self.stuck = True
                await self.role.set_serving(False)
                error = f"the LM worker's step has been stuck for over {timeout:.0f}s"
                ended = self.frontend.fail_all(error, "stuck")
                logger.error(
                    "engine step stuck for %.0fs: NOT_SERVING, ended %d streams",
                    time.monotonic() - since,
                    ended,
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
            await asyncio.to_thread(self.engine.kv.close)
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        if self.connector is not None:
            await self.connector.close()
        if self.streams is not None:
            await self.streams.close()

    async def Generate(self, request: epd_pb2.LMGenerateRequest, context):
        async with self.role.work(context):
            tracer = tracing.tracer()
            span = tracing.server_span(
                "lm.generate",
                context,
                worker=self.name,
                prompt_tokens=len(request.prompt_token_ids),
                items=len(request.mm_features),
                kv_handover=request.kv_handover,
            )
            req = None
            try:
                req = to_request(request)
                handover = Handover(
                    request.kv_handover,
                    request.kv_target,
                    request.rope_delta if request.HasField("rope_delta") else None,
                )
                async with contextlib.aclosing(self.frontend.generate(req, handover)) as outputs:
                    async for out in outputs:
                        if isinstance(out, Missing):
                            msg = epd_pb2.LMGenerateResponse(missing_mm_hashes=out.mm_hashes)
                        else:
                            msg = to_response(out)
                        await context.write(msg)
            except Exception as e:
                code = status_of(e)
                if code is None:
                    raise
                await context.abort(code, str(e))
            finally:
                if req is not None:
                    self.engine.metrics.stages.observe(req.stages)
                    tracer.end(span, req.stages, output_tokens=len(req.output_token_ids))
                else:
                    tracer.end(span)

    async def Abort(self, request: epd_pb2.AbortRequest, context) -> epd_pb2.AbortResponse:
        """Abort a request in any state: waiting for its embeddings (the wait is cancelled and
        its stream ends with FINISH_REASON_ABORT) or in the engine."""
        return epd_pb2.AbortResponse(aborted=self.frontend.abort(request.request_id))

    async def GetLoad(self, request, context) -> epd_pb2.LMLoad:
        if self.engine is None or self.frontend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the LM worker is still loading")
        load = self.engine.load()
        blocks = self.engine.scheduler.blocks
        return epd_pb2.LMLoad(
            prefix_block_size=blocks.block_size if blocks.enable_prefix_caching else 0,
            worker_id=self.name,
            waiting_for_embeddings=self.frontend.fetcher.waiting,
            role=self.config.lm.role,
            kv_tier=self.config.lm.kv_tier,
            kv_address=self.kv_address,
            realtime_sessions=self.frontend.feeder.open,
            realtime_rows=self.engine.realtime_rows(),
            realtime_waiting_steps=self.engine.realtime_waiting_steps,
            **load,
            **_fetches_by_tier(self.connector),
            **kv_counters(self.engine.kv),
        )


def kv_counters(kv: KVConnector) -> dict[str, float]:
    """The KV tier's counters as LMLoad's kv_* fields (none without a tier)."""
    metrics = kv.metrics
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


def _exit_on_lost_rank(why: str) -> None:
    """The worker cannot step without all its ranks: exit now, so that the proxy moves its
    streams to another worker (their connections break) and `epd up` restarts it whole (the
    other ranks exit as their pipe from this process closes)."""
    logger.critical("%s: the LM worker exits", why)
    logging.shutdown()
    os._exit(1)


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = LanguageModelServicer(config, name)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["LanguageModel"].full_name,
        servicer,
        epd_pb2_grpc.add_LanguageModelServicer_to_server,
    )
    credentials = cluster_server_credentials(config.cluster.tls)
    token = required_token(config.cluster)  # only the proxy may call (cluster_auth)
    server = servicer.role = RoleServer(name, config.lm.listen, [service], credentials, token)
    options = config.heartbeat_options("lm")
    heartbeat = Heartbeat(**options) if options else None
    return await run_worker(config.lm, server, servicer.load, servicer.close, heartbeat)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
