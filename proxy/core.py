"""The proxy's core: everything a request needs, shared by both APIs (gRPC in server.py, HTTP
in http.py) and read by the dashboard. It imports neither of them.

Start-up (made by server.py once Redis answers): the served model (tokenizer, header-only media
processor, fingerprint), the EC connector, the worker pools. Each request: prepare
(proxy/prepare.py) -> run (proxy/frontend.py), with admission control and latency metrics here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis

from common import tracing
from common.config import ClusterConfig
from common.media import MODALITIES
from common.served_model import ServedModel
from common.signing import HashSigner
from connector import AsyncECConnector
from connector.client import async_client
from proto import epd_pb2, epd_pb2_grpc
from proxy.affinity import Affinity
from proxy.frontend import Chunk, Frontend
from proxy.metrics import ProxyMetrics
from proxy.planner import Planner, planner_key
from proxy.prepare import ChatMessage, PreparedRequest, RequestBuilder
from proxy.realtime import RealtimeService
from proxy.timeline import Timeline
from proxy.validate import Limits, check_prepared, check_structured
from proxy.workers import WorkerPool

logger = logging.getLogger(__name__)

# The planner's write to Redis may take this long (seconds) before the tick goes on without it.
PUBLISH_TIMEOUT = 1.0
# Prompts with fewer characters are built on the event loop (cheaper than a thread hop).
INLINE_CHARS = 16384


def _chars(prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], ChatMessage):
        return sum(len(p.text or "") for m in prompt for p in m.parts)
    return 0


class Overloaded(RuntimeError):
    """Every slot is taken (RESOURCE_EXHAUSTED / HTTP 429)."""


class ModelNotFound(LookupError):
    pass


class Proxy:
    """Everything a request needs, shared by both APIs."""

    def __init__(self, config: ClusterConfig, served: ServedModel, metrics: ProxyMetrics):
        self.config = config
        self.served = served
        self.metrics = metrics
        self.builder = RequestBuilder(served, config.proxy.max_item_tokens)
        family = served.family
        self.card = epd_pb2.ModelCard(
            id=served.name,
            architecture=family.architecture,
            max_model_len=family.text.max_position_embeddings,
            modalities=[MODALITIES[m] for m in family.modalities],
        )
        c = config
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint, **c.connector.store_options()
        )
        self.redis = async_client(c.connector.redis_url, mode=c.connector.mode)
        gauges = {"up_gauge": metrics.worker_up, "circuit_gauge": metrics.worker_circuit_open}
        self.encoders = WorkerPool(
            "encoder", epd_pb2_grpc.EncoderStub, c.proxy.encoders, c, self.redis, **gauges
        )
        self.lms = WorkerPool(
            "lm", epd_pb2_grpc.LanguageModelStub, c.proxy.lm_workers, c, self.redis, **gauges
        )
        affinity = Affinity(
            c.proxy.prefix_affinity_blocks,
            c.proxy.prefix_affinity_margin_tokens,
            metrics.affinity_routes,
        )
        metrics.affinity_blocks.set_function(lambda: len(affinity.index))
        self.frontend = Frontend(
            self.connector,
            self.encoders,
            self.lms,
            metrics,
            c.proxy.retries,
            c.proxy.request_timeout_seconds,
            c.proxy.encode_mark_ttl_seconds,
            affinity,
        )
        self.frontend.dispatcher.signer = HashSigner(c.cluster.signing_key())
        self.pending = 0
        self.context = c.lm.context_length(family.text.max_position_embeddings)
        self.realtime = RealtimeService(self)
        self.timeline = Timeline()  # the dashboard's slowest recent requests
        p = c.proxy
        self.planner = Planner(
            p.encoder_target_utilisation,
            p.encoder_wait_slo_seconds,
            p.encoders_min,
            p.encoders_max,
            p.encoder_scale_down_seconds,
        )
        self._planning: asyncio.Task | None = None
        # The planner's answer and inputs on /metrics, read off its last decision (0 before one).
        planner_gauges = (
            (metrics.encoders_desired, "desired"),
            (metrics.planner_need, "need"),
            (metrics.planner_work, "work"),
            (metrics.planner_backlog, "backlog_seconds"),
            (metrics.planner_seconds_per_item, "seconds_per_item"),
        )
        for gauge, name in planner_gauges:
            gauge.set_function(lambda name=name: getattr(self.planner.last, name, None) or 0)

    async def start(self) -> None:
        await self.encoders.start()
        await self.lms.start()
        self._planning = asyncio.create_task(self._plan(), name="encoder-planner")

    async def _plan(self) -> None:
        """The encoder planner's tick, once per load poll: a decision from the SERVING
        encoders' reports, on /metrics and in Redis (best effort: a store that does not answer
        costs the local launcher its input for a while, nothing else)."""
        key = planner_key(self.config.connector.namespace)
        owner = self.frontend.dispatcher.owner
        while True:
            await asyncio.sleep(self.config.proxy.load_poll_seconds)
            loads = [w.load for w in self.encoders.workers.values() if w.up and w.load]
            decision = self.planner.update(loads)
            try:  # bounded: a hung store must not stop the ticks (the metrics go on)
                await asyncio.wait_for(
                    self.redis.hset(key, owner, decision.to_json(time.time())), PUBLISH_TIMEOUT
                )
            except (redis.RedisError, TimeoutError) as e:
                logger.debug("planner: could not publish to Redis: %r", e)

    async def close(self) -> None:
        if self._planning is not None:
            self._planning.cancel()
            await asyncio.gather(self._planning, return_exceptions=True)
            with contextlib.suppress(redis.RedisError, TimeoutError):
                key = planner_key(self.config.connector.namespace)
                owner = self.frontend.dispatcher.owner
                await asyncio.wait_for(self.redis.hdel(key, owner), PUBLISH_TIMEOUT)
        await self.realtime.close()
        await self.encoders.close()
        await self.lms.close()
        await self.connector.close()
        await self.redis.aclose()

    def check_model(self, name: str) -> None:
        if name and name != self.served.name:
            raise ModelNotFound(f"The model `{name}` does not exist.")

    def limits(self) -> Limits:
        """The edge's limits now. The context is the largest an LM worker reported (a worker
        may serve less than its config says: its KV cache cuts it), or before any report, the
        configured one. The worker checks again against its own."""
        p = self.config.proxy
        reported = [w.load.max_model_len for w in self.lms.workers.values() if w.load]
        context = max(reported, default=0) or self.context
        return Limits(
            p.max_body_bytes,
            p.max_media_items,
            p.max_item_tokens,
            context,
            p.max_messages,
            p.max_content_parts,
        )

    async def prepare(self, build, prompt, media, *args, **kwargs) -> PreparedRequest:
        """The request built and checked against the limits, before any encode is dispatched.
        Hashing media, reading its headers and tokenizing long text is CPU work: off the event
        loop. A short text-only prompt costs tens of microseconds, less than the hop to a
        thread."""
        started = tracing.now_ns()
        if not media and _chars(prompt) < INLINE_CHARS:
            prepared = build(prompt, media, *args, **kwargs)
        else:
            prepared = await asyncio.to_thread(build, prompt, media, *args, **kwargs)
        check_prepared(prepared, self.limits())
        await check_structured(prepared.sampling)
        prepared.stages.add("validate", started, items=len(prepared.items))
        return prepared

    async def run(self, prepared: PreparedRequest, timeout: float | None) -> AsyncIterator[Chunk]:
        """The request's chunks, with admission control, deadline and latency metrics."""
        if self.pending >= self.config.proxy.max_pending_requests:
            raise Overloaded(
                f"{self.pending} requests are in flight (proxy.max_pending_requests); retry later"
            )
        limit = self.config.proxy.request_timeout_seconds
        deadline = time.monotonic() + (min(timeout, limit) if timeout else limit)
        self.pending += 1
        self.metrics.pending.set(self.pending)
        first = last = None
        stages = prepared.stages
        prepared.span = tracing.tracer().start(
            "proxy.request",
            prepared.trace_parent,
            stages[0].start if stages else None,
            request_id=prepared.request_id,
            items=len(prepared.items),
            prompt_tokens=len(prepared.prompt_token_ids),
        )
        finish = None
        try:
            async for chunk in self.frontend.generate(prepared, deadline):
                now = time.monotonic()
                if chunk.token_ids:
                    if first is None:
                        first = now
                        self.metrics.observe_ttft(now - prepared.arrival)
                    else:
                        self.metrics.observe_itl(now - last)
                    last = now
                if chunk.timings is not None:
                    if first is not None:
                        chunk.timings.time_to_first_token_seconds = first - prepared.arrival
                        chunk.timings.decode_seconds = now - first
                    chunk.timings.total_seconds = now - prepared.arrival
                    finish = chunk
                yield chunk
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)
            self.metrics.stages.observe(stages)
            attributes = {"finished": finish is not None}
            if finish is not None and finish.usage is not None:
                attributes["completion_tokens"] = finish.usage.completion_tokens
                attributes["held_items"] = finish.usage.mm_items_held
            tracing.tracer().end(prepared.span, stages, **attributes)
            timings = finish.timings if finish is not None else None
            self.timeline.add(prepared.request_id, stages, timings, ok=finish is not None)
