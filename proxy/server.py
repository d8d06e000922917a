"""The proxy: the cluster's front door, gRPC `Inference` and the HTTP API in one process.

Start-up: wait for Redis, resolve the served model (tokenizer, header-only media processor,
fingerprint), find the workers (static addresses + the Redis registry) and watch their health.
Each request: prepare (proxy/prepare.py) -> run (proxy/frontend.py) -> stream out. Protobuf
stops at this file and at http.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from connector import AsyncECConnector, connector_options, wait_until_reachable
from connector.client import async_client
from epd.config import ClusterConfig
from epd.media import media_from_proto
from epd.served_model import ServedModel, resolve_model
from epd.server import RoleServer, Service, run_role, unimplemented
from models import MediaError, load_arch_config
from proto import epd_pb2, epd_pb2_grpc
from proxy.encode import Unavailable
from proxy.frontend import Chunk, Frontend
from proxy.http import HttpApi
from proxy.metrics import ProxyMetrics
from proxy.prepare import BadInput, ChatMessage, Part, PreparedRequest, RequestBuilder
from proxy.workers import WorkerPool

logger = logging.getLogger(__name__)


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
        self.builder = RequestBuilder(served)
        arch = load_arch_config(served.path)
        self.card = epd_pb2.ModelCard(
            id=served.name,
            architecture=arch.architecture,
            max_model_len=arch.text.max_position_embeddings,
            modalities=[epd_pb2.MODALITY_IMAGE, epd_pb2.MODALITY_VIDEO],
        )
        c = config
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint, **connector_options(c.connector)
        )
        self.redis = async_client(c.connector.url)
        gauges = {"up_gauge": metrics.worker_up, "circuit_gauge": metrics.worker_circuit_open}
        self.encoders = WorkerPool(
            "encoder", epd_pb2_grpc.EncoderStub, c.proxy.encoders, c, self.redis, **gauges
        )
        self.lms = WorkerPool(
            "lm", epd_pb2_grpc.LanguageModelStub, c.proxy.lm_workers, c, self.redis, **gauges
        )
        self.frontend = Frontend(self.connector, self.encoders, self.lms, metrics, c.proxy.retries)
        self.pending = 0

    async def start(self) -> None:
        await self.encoders.start()
        await self.lms.start()

    async def close(self) -> None:
        await self.encoders.close()
        await self.lms.close()
        await self.connector.close()
        await self.redis.aclose()

    def check_model(self, name: str) -> None:
        if name and name != self.served.name:
            raise ModelNotFound(f"The model `{name}` does not exist.")

    async def prepare(self, build, prompt, media, *args) -> PreparedRequest:
        """Hashing media and reading its headers is CPU work: off the event loop. A text-only
        prompt costs tens of microseconds, less than the hop to a thread."""
        if not media:
            return build(prompt, media, *args)
        return await asyncio.to_thread(build, prompt, media, *args)

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
                yield chunk
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)


def chat_from_proto(chat: epd_pb2.ChatPrompt) -> list[ChatMessage]:
    def part(p: epd_pb2.ContentPart) -> Part:
        if p.WhichOneof("part") == "media_index":
            return Part(media_index=p.media_index)
        return Part(text=p.text)

    return [ChatMessage(m.role, tuple(part(p) for p in m.content)) for m in chat.messages]


class InferenceServicer(epd_pb2_grpc.InferenceServicer):
    def __init__(self, proxy_ref: list[Proxy]):
        self._proxy = proxy_ref  # filled at load; RPCs before SERVING are refused
        self.role: RoleServer | None = None

    @property
    def proxy(self) -> Proxy:
        return self._proxy[0]

    async def Generate(self, request: epd_pb2.GenerateRequest, context):
        async with self.role.work(context):
            proxy = self.proxy
            status = grpc.StatusCode.OK
            try:
                proxy.check_model(request.model)
                media = [media_from_proto(m) for m in request.media]
                kind = request.WhichOneof("prompt")
                if kind == "chat":
                    prompt = chat_from_proto(request.chat)
                elif kind == "token_ids":
                    prompt = list(request.token_ids.ids)
                elif kind == "text":
                    prompt = request.text
                else:
                    raise BadInput("set one of text, chat or token_ids")
                prepared = await proxy.prepare(
                    proxy.builder.build,
                    prompt,
                    media,
                    request.sampling,
                    request.request_id,
                    request.chat.continue_final_message if kind == "chat" else False,
                    request.return_prompt_token_ids,
                )
                first = True
                async for chunk in proxy.run(prepared, context.time_remaining()):
                    msg = to_response(prepared.request_id, chunk)
                    if first and prepared.return_prompt_token_ids:
                        msg.prompt_token_ids.extend(prepared.prompt_token_ids)
                    first = False
                    await context.write(msg)
            except (BadInput, MediaError) as e:
                status = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(status, str(e))
            except ModelNotFound as e:
                status = grpc.StatusCode.NOT_FOUND
                await context.abort(status, str(e))
            except Overloaded as e:
                status = grpc.StatusCode.RESOURCE_EXHAUSTED
                await context.abort(status, str(e))
            except Unavailable as e:
                status = grpc.StatusCode.UNAVAILABLE
                await context.abort(status, str(e))
            except grpc.aio.AioRpcError as e:
                status = e.code()
                await context.abort(status, f"LM worker: {e.details()}")
            except asyncio.CancelledError:
                status = grpc.StatusCode.CANCELLED
                raise
            finally:
                proxy.metrics.requests.labels("grpc", status.name).inc()

    async def Realtime(self, request_iterator, context):
        await unimplemented(context, "Inference.Realtime", "a realtime audio model (Voxtral)")

    async def Abort(self, request: epd_pb2.AbortRequest, context) -> epd_pb2.AbortResponse:
        try:
            return epd_pb2.AbortResponse(
                aborted=await self.proxy.frontend.abort(request.request_id)
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"LM worker: {e.details()}")

    async def ListModels(self, request, context) -> epd_pb2.ListModelsResponse:
        return epd_pb2.ListModelsResponse(models=[self.proxy.card])


def to_response(request_id: str, chunk: Chunk) -> epd_pb2.GenerateResponse:
    msg = epd_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=chunk.logprobs,
        finish_reason=chunk.finish_reason,
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(chunk.usage)
    if chunk.timings is not None:
        msg.timings.CopyFrom(chunk.timings)
    return msg


async def serve(config: ClusterConfig, name: str) -> int:
    proxy_ref: list[Proxy] = []
    servicer = InferenceServicer(proxy_ref)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        servicer,
        epd_pb2_grpc.add_InferenceServicer_to_server,
    )
    listen = f"{config.proxy.host}:{config.proxy.grpc_port}"
    server = servicer.role = RoleServer(name, listen, [service])
    http = HttpApi(proxy_ref, server)

    async def load() -> None:
        await http.start(config.proxy.host, config.proxy.http_port)
        await wait_until_reachable(config.connector.url, config.connector.startup_wait_seconds)
        served = await asyncio.to_thread(resolve_model, config)
        proxy = await asyncio.to_thread(Proxy, config, served, ProxyMetrics())
        await proxy.start()
        proxy_ref.append(proxy)

    async def on_serving() -> None:
        http.serving = True

    async def on_drain() -> None:
        http.serving = False

    try:
        return await run_role(
            server,
            load,
            config.proxy.drain_timeout_seconds,
            on_serving=on_serving,
            on_drain=on_drain,
        )
    finally:
        await http.stop()
        if proxy_ref:
            await proxy_ref[0].close()


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
