"""Who may call a worker: only the proxy.

    proxy --(metadata x-epd-cluster-token: HMAC(cluster secret))--> encoder / LM worker

A worker's port answers the proxy and nobody else. With mTLS (cluster.tls) the client
certificate already says so, before any RPC. Without it, every call but grpc.health.v1 (what
probes, `epd health` and the launcher ask) must carry a token derived from the cluster secret,
which only the proxy and the workers hold; the worker compares it in constant time and answers
UNAUTHENTICATED otherwise. The token is one fixed value per secret: it shows nothing of the
secret, but like everything on a plaintext link it can be read off the wire there, which is
what cluster.tls is for.

One rule, read once at start-up (`required_token`): a worker with a cluster secret and without
cluster.tls requires the token; a worker without a secret (an LM worker run by hand with none
configured) is open, as before. The proxy attaches the token to every call whenever it has the
secret (`call_token`), which costs nothing where the worker does not ask for it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.config import SecurityConfig

METADATA_KEY = "x-epd-cluster-token"
_CONTEXT = b"epd-worker-call-v1\0"
_OPEN_PREFIX = "/grpc.health.v1.Health/"  # probes stay open
REFUSAL = (
    "this port answers only the proxy: calls need the cluster token (metadata "
    f"{METADATA_KEY}, derived from cluster.secret); go through the proxy"
)


def token_for(key: bytes) -> str:
    """The call token of the cluster secret `key` (hex HMAC-SHA256; not the secret)."""
    return hmac.new(key, _CONTEXT, hashlib.sha256).hexdigest()


def call_token(cluster: SecurityConfig) -> str | None:
    """What a client of the workers (the proxy, tools) attaches; None without a secret."""
    if cluster.secret is None and cluster.secret_file is None:
        return None
    return token_for(cluster.signing_key())


def required_token(cluster: SecurityConfig) -> str | None:
    """What a worker requires of every call but health; None: nothing (mTLS, or no secret)."""
    if cluster.tls.enabled:
        return None
    return call_token(cluster)


class RequireToken(grpc.aio.ServerInterceptor):
    """The worker side: every method but grpc.health.v1's needs the token (reflection too)."""

    def __init__(self, token: str):
        self._token = token.encode()

    def admits(self, metadata: Any) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(presented, self._token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        if self.admits(details.invocation_metadata):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that answers UNAUTHENTICATED without reading anything."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # not reached: makes this an async generator, what streaming responses are

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class _AioToken:
    def __init__(self, token: str):
        self.token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, self.token))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One object per call shape: a grpc.aio channel files each interceptor under one shape only.
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self.token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _ClientCallDetails(details, [*(details.metadata or ()), (METADATA_KEY, self.token)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def aio_interceptors(token: str | None) -> list:
    """A grpc.aio channel's interceptors that attach `token` to every call (none: [])."""
    if token is None:
        return []
    return [
        cls(token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    ]


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """A blocking channel that attaches `token` to every call (None: `channel` itself)."""
    return channel if token is None else grpc.intercept_channel(channel, _Token(token))
