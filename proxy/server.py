"""The proxy: the cluster's front door, gRPC `Inference` and the HTTP API in one process.

Start-up: bind both APIs (NOT_SERVING, HTTP 503), wait for Redis, resolve the served model,
build the `Proxy` (proxy/core.py: the workers, found from static addresses and the Redis
registry, watched for health), then SERVING. Each request: prepare (proxy/prepare.py) -> run
(proxy/frontend.py) -> stream out. Protobuf stops at this file and at http.py.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.config import ClusterConfig
from common.media import media_from_proto
from common.served_model import resolve_model
from common.server import RoleServer, Service, run_role, unimplemented
from connector import wait_until_reachable
from models import MediaError
from proto import epd_pb2, epd_pb2_grpc
from proxy.core import ModelNotFound, Overloaded, Proxy
from proxy.encode import Unavailable
from proxy.frontend import Chunk
from proxy.http import HttpApi
from proxy.metrics import ProxyMetrics
from proxy.prepare import BadInput, ChatMessage, Part
from proxy.validate import check_generate, refuse_malformed, tolerant_add

logger = logging.getLogger(__name__)


def chat_from_proto(chat: epd_pb2.ChatPrompt) -> list[ChatMessage]:
    def part(p: epd_pb2.ContentPart) -> Part:
        if p.WhichOneof("part") == "media_index":
            return Part(media_index=p.media_index)
        return Part(text=p.text)

    return [ChatMessage(m.role, tuple(part(p) for p in m.content)) for m in chat.messages]


class InferenceServicer(epd_pb2_grpc.InferenceServicer):
    def __init__(self):
        self.proxy: Proxy | None = None  # set once loaded; RPCs before SERVING are refused
        self.role: RoleServer | None = None

    async def Generate(self, request: epd_pb2.GenerateRequest, context):
        await refuse_malformed(request, context)
        async with self.role.work(context):
            proxy = self.proxy
            status = grpc.StatusCode.OK
            try:
                proxy.check_model(request.model)
                check_generate(request, proxy.limits(), proxy.served.family.text.vocab_size)
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
        await unimplemented(context, "Inference.Realtime", "a realtime audio model")

    async def Abort(self, request: epd_pb2.AbortRequest, context) -> epd_pb2.AbortResponse:
        await refuse_malformed(request, context)
        try:
            return epd_pb2.AbortResponse(
                aborted=await self.proxy.frontend.abort(request.request_id)
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"LM worker: {e.details()}")

    async def ListModels(self, request, context) -> epd_pb2.ListModelsResponse:
        await refuse_malformed(request, context)
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
    servicer = InferenceServicer()
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        servicer,
        tolerant_add(epd_pb2_grpc.add_InferenceServicer_to_server),
    )
    listen = f"{config.proxy.host}:{config.proxy.grpc_port}"
    server = servicer.role = RoleServer(name, listen, [service])
    http = HttpApi(server)

    async def load() -> None:
        await http.start(config.proxy.host, config.proxy.http_port)
        await wait_until_reachable(
            config.connector.url, config.connector.startup_wait_seconds, config.connector.mode
        )
        served = await asyncio.to_thread(resolve_model, config)
        proxy = await asyncio.to_thread(Proxy, config, served, ProxyMetrics())
        await proxy.start()
        servicer.proxy = proxy
        http.attach(proxy)

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
        if servicer.proxy is not None:
            await servicer.proxy.close()


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
