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

from common import tracing
from common.config import ClusterConfig
from common.media import media_from_proto
from common.served_model import resolve_model
from common.server import RoleServer, Service, run_role
from common.tls import http_context, server_credentials
from connector import wait_until_reachable
from models import MediaError
from proto import epd_pb2, epd_pb2_grpc
from proxy.auth import KeyRing, Principal, grpc_principal, http_middleware
from proxy.core import ModelNotFound, Overloaded, Proxy
from proxy.encode import Unavailable
from proxy.frontend import Chunk
from proxy.http import HttpApi
from proxy.metrics import ProxyMetrics
from proxy.prepare import BadInput, ChatMessage, Part
from proxy.realtime import grpc_session
from proxy.tools import tool_functions
from proxy.validate import check_generate, refuse_malformed, tolerant_add

logger = logging.getLogger(__name__)


def chat_from_proto(chat: epd_pb2.ChatPrompt) -> list[ChatMessage]:
    def part(p: epd_pb2.ContentPart) -> Part:
        if p.WhichOneof("part") == "media_index":
            return Part(media_index=p.media_index)
        return Part(text=p.text)

    return [ChatMessage(m.role, tuple(part(p) for p in m.content)) for m in chat.messages]


class InferenceServicer(epd_pb2_grpc.InferenceServicer):
    def __init__(self, keys: KeyRing | None = None):
        self.proxy: Proxy | None = None  # set once loaded; RPCs before SERVING are refused
        self.role: RoleServer | None = None
        self.keys = keys or KeyRing([])

    def owner(self, principal: Principal, context: grpc.aio.ServicerContext) -> str:
        """Who may abort the requests this call starts, and whose this call may abort: with
        keys, the key; without, the connection (a client's Abort goes over the channel its
        Generate did). Another caller's id, guessed or collided, aborts nothing of theirs."""
        if self.keys.enabled:
            return f"key:{principal.key_id}"
        return f"peer:{context.peer()}"

    async def Generate(self, request: epd_pb2.GenerateRequest, context):
        principal = await grpc_principal(self.keys, context)
        await refuse_malformed(request, context)
        async with self.role.work(context):
            proxy = self.proxy
            status = grpc.StatusCode.OK
            prepared = None
            try:
                proxy.check_model(request.model)
                check_generate(request, proxy.limits(), proxy.served.family.text.vocab_size)
                media = [media_from_proto(m) for m in request.media]
                kind = request.WhichOneof("prompt")
                tools = []
                if kind == "chat":
                    prompt = chat_from_proto(request.chat)
                    tools = tool_functions(request.chat)
                elif kind == "token_ids":
                    prompt = list(request.token_ids.ids)
                elif kind == "text":
                    prompt = request.text
                elif proxy.served.family.prompt_from_media:  # the family builds the prompt
                    prompt = ""
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
                    tenant=principal.tenant,
                    tools=tools,
                )
                prepared.owner = self.owner(principal, context)
                prepared.trace_parent = tracing.tracer().extract(context.invocation_metadata())
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
        """A realtime audio session (proxy/realtime.py)."""
        await grpc_principal(self.keys, context)
        async with self.role.work(context):
            async for msg in grpc_session(self.proxy.realtime, request_iterator, context):
                yield msg

    async def Abort(self, request: epd_pb2.AbortRequest, context) -> epd_pb2.AbortResponse:
        principal = await grpc_principal(self.keys, context)
        await refuse_malformed(request, context)
        # Another caller's request is answered as an unknown one: its id reveals nothing.
        owner = self.owner(principal, context)
        try:
            return epd_pb2.AbortResponse(
                aborted=await self.proxy.frontend.abort(request.request_id, owner)
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"LM worker: {e.details()}")

    async def ListModels(self, request, context) -> epd_pb2.ListModelsResponse:
        await grpc_principal(self.keys, context)
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
    p = config.proxy
    keys = KeyRing.from_config(p)
    if keys.enabled:
        logger.info("API keys: %d configured; /health is open (its detail needs one)", len(keys))
    elif p.host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning(
            "no API keys are configured and the proxy listens on %s: anyone who can reach it "
            "can use it (set proxy.api_keys_file or EPD_PROXY_API_KEYS)",
            p.host,
        )
    servicer = InferenceServicer(keys)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        servicer,
        tolerant_add(epd_pb2_grpc.add_InferenceServicer_to_server),
    )
    listen = f"{p.host}:{p.grpc_port}"
    credentials = server_credentials(p.tls_cert, p.tls_key) if p.tls_cert else None
    tls = http_context(p.tls_cert, p.tls_key) if p.tls_cert else None
    server = servicer.role = RoleServer(name, listen, [service], credentials)
    http = HttpApi(server, [http_middleware(keys, p)])

    async def load() -> None:
        await http.start(p.host, p.http_port, tls)
        c = config.connector
        await wait_until_reachable(c.redis_url, c.startup_wait_seconds, c.mode)
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
