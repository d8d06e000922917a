"""The life cycle every role's gRPC server shares.

    bind (health NOT_SERVING) -> load and warm up -> SERVING -> SIGTERM / SIGINT
        -> NOT_SERVING, refuse new work with UNAVAILABLE -> finish work in flight -> exit

Besides the role's own services, every server answers grpc.health.v1 (what Kubernetes probes
and the proxy watches) and server reflection (so grpcurl and friends work without the .proto).
A worker's server answers only the proxy (common/cluster_auth.py): health is open to all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from common.cluster_auth import RequireToken
from common.config import parse_address

logger = logging.getLogger(__name__)

# Media items travel inside requests (embeddings never do: they go through the connector).
MAX_MESSAGE_BYTES = 128 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# Servers accept the keepalive pings of CHANNEL_OPTIONS' clients (not counted as abuse).
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
# Channels to workers ping every second even when idle and give up after 3 s without an
# answer: a cut link (no RST, no FIN) or a frozen worker (SIGSTOP: the kernel still ACKs its
# TCP, only the process does not answer) fails its calls and health watch within about 4 s
# instead of hanging until the request's deadline. (3 s, not less: a worker on an overloaded
# host may answer a ping seconds late, and a false alarm costs a retry or a migration.)
# NOTE: gRPC core times a ping out by grpc.http2.ping_timeout_ms (default 60 s), whatever
# keepalive_timeout_ms says: without it a frozen worker stayed SERVING for about 64 s.
# A worker that comes (back) up is seen within about 0.6 s: the channel redials at most every
# 0.5 s (+20% jitter) and the proxy's health watch retries every 0.25 s (proxy/workers.py).
# gRPC's default backoff (1 s, x1.6 a failure, up to 120 s) left a worker down for 20 s unseen
# for 6 s after it was up; a 2 s cap still left 3.1 s, past the proxy's 2 s wait for a worker.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.http2.ping_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Service:
    name: str  # full service name, e.g. "epd.v1.Encoder"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


class RoleServer:
    """A grpc.aio server for one role, with health, reflection and draining."""

    def __init__(
        self,
        role: str,
        listen: str,
        services: Sequence[Service],
        credentials: grpc.ServerCredentials | None = None,
        token: str | None = None,
    ):
        """`credentials`: TLS (common/tls.py) on the one port, health included; None: plain.
        `token`: every call but health must carry this cluster token (common/cluster_auth.py:
        a worker answers only the proxy); None: no such check."""
        self.role = role
        self.listen = listen
        self.credentials = credentials
        self.services = list(services)
        interceptors = [] if token is None else [RequireToken(token)]
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = HealthServicer()
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        for service in self.services:
            service.add_to_server(service.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [s.name for s in self.services]
            + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )

    @property
    def health_names(self) -> list[str]:
        return ["", *(s.name for s in self.services)]

    async def start(self) -> int:
        """Bind and start answering (NOT_SERVING until `set_serving`). Returns the bound port."""
        for name in self.health_names:
            await self.health.set(name, NOT_SERVING)
        try:
            if self.credentials is not None:
                port = self.server.add_secure_port(self.listen, self.credentials)
            else:
                port = self.server.add_insecure_port(self.listen)
        except RuntimeError as e:
            raise OSError(f"{self.role} cannot listen on {self.listen}: {e} (port in use?)") from e
        await self.server.start()
        return port

    async def set_serving(self, serving: bool = True) -> None:
        """SERVING (or, with False, NOT_SERVING: the proxy stops routing here) for every
        service name."""
        for name in self.health_names:
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    @contextlib.asynccontextmanager
    async def work(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Wrap the body of every RPC that does real work: refused while draining, and counted
        so that draining waits for it."""
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.role} is draining; send this elsewhere"
            )
        async with self.track():
            yield

    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        """Count work in flight that is not a gRPC call (the proxy's HTTP requests), so that
        draining waits for it too. The caller refuses new work while `draining` itself."""
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def drain(self, timeout: float) -> None:
        """NOT_SERVING, refuse new work, wait up to `timeout` for work in flight, then stop."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        if self.inflight:
            logger.info("draining: %d RPCs in flight (up to %.0fs)", self.inflight, timeout)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                logger.warning("drain timeout: cancelling %d RPCs still in flight", self.inflight)
        # What is left (health watches, reflection) ends now.
        await self.server.stop(grace=None)


async def run_role(
    server: RoleServer,
    load: Callable[[], Awaitable[None]],
    drain_timeout: float,
    on_serving: Callable[[], Awaitable[None]] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Run `server` until SIGTERM / SIGINT. Returns the process exit code.

    `load` runs after the server is bound (health says NOT_SERVING meanwhile); a signal during
    load stops at once. `on_serving` / `on_drain` start and stop what the role serves besides
    gRPC (the proxy's HTTP API)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    port = await server.start()
    logger.info("%s listening on port %d (NOT_SERVING until loaded)", server.role, port)
    started = time.monotonic()
    load_task = asyncio.create_task(load())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([load_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
    if not load_task.done():
        logger.info("stopped during start-up")
        load_task.cancel()
        await server.drain(0)
        return 0
    if load_task.exception() is not None:
        logger.error("start-up failed: %s", load_task.exception())
        stop_task.cancel()
        await server.drain(0)
        return 1

    if on_serving is not None:
        await on_serving()
    await server.set_serving()
    logger.info("%s SERVING (ready in %.1fs)", server.role, time.monotonic() - started)
    await stop_task
    logger.info("%s draining", server.role)
    if on_drain is not None:
        await on_drain()
    await server.drain(drain_timeout)
    logger.info("%s stopped", server.role)
    return 0


class Registration(Protocol):
    """A worker's place in the registry (connector.registry.Heartbeat): `start` once SERVING,
    `stop` when draining."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def run_worker(
    section: Any,  # EncoderConfig | LMConfig: listen, metrics_port, drain_timeout_seconds
    server: RoleServer,
    load: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
    registration: Registration | None,
) -> int:
    """A worker role's whole life: its /metrics server, run_role, its registration (None: the
    registry is off) started once SERVING and stopped when draining, then `close`."""
    try:
        stop_metrics = serve_metrics(section.listen, section.metrics_port)
    except OSError as e:
        logger.error("%s", e)
        return 1
    try:
        return await run_role(
            server,
            load,
            section.drain_timeout_seconds,
            on_serving=registration.start if registration else None,
            on_drain=registration.stop if registration else None,
        )
    finally:
        await close()
        if stop_metrics is not None:
            stop_metrics()


def serve_metrics(listen: str, port: int) -> Callable[[], None] | None:
    """Prometheus /metrics of this process over HTTP on (listen's host, port), in a thread.
    Returns its shutdown, or None when port is 0 (off). OSError when the port is taken."""
    if not port:
        return None
    host, _ = parse_address(listen)
    try:
        server, _thread = start_http_server(port, host)
    except OSError as e:
        raise OSError(f"cannot serve /metrics on {host}:{port}: {e.strerror}") from e
    logger.info("/metrics on %s:%d", host, port)
    return server.shutdown
