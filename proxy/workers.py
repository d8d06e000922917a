"""The proxy's view of its workers: who is there, who is healthy, who is least loaded.

Each worker has a gRPC channel, a grpc.health.v1 Watch stream (SERVING or not, seen the moment
it changes; a broken stream marks it down), a circuit breaker (opened by consecutive failed
calls, half-open after a cooldown), its last reported load (GetLoad, polled) and the proxy's own
count of work it has sent there and not seen finish. Workers come from the static addresses in
the config and from the Redis registry (connector/registry.py), re-read every `refresh` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Gauge

from common.cluster_auth import call_token
from common.server import CHANNEL_OPTIONS
from common.tls import cluster_aio_channel
from connector.registry import live_workers
from proto import epd_pb2

logger = logging.getLogger(__name__)


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass
class Breaker:
    failures_to_open: int
    cooldown: float
    failures: int = 0
    opened_at: float = 0.0
    state: Circuit = Circuit.CLOSED

    def allows(self) -> bool:
        if self.state is Circuit.OPEN and time.monotonic() - self.opened_at >= self.cooldown:
            self.state = Circuit.HALF_OPEN  # one call may try
        return self.state is not Circuit.OPEN

    def success(self) -> None:
        self.failures = 0
        self.state = Circuit.CLOSED

    def failure(self) -> None:
        self.failures += 1
        if self.state is Circuit.HALF_OPEN or self.failures >= self.failures_to_open:
            self.state = Circuit.OPEN
            self.opened_at = time.monotonic()


@dataclass
class Worker:
    role: str
    address: str
    source: str  # "static" | "registry"
    channel: grpc.aio.Channel
    stub: Any
    breaker: Breaker
    status: str = "UNKNOWN"  # SERVING | NOT_SERVING | UNREACHABLE | UNKNOWN
    load: Any = None  # the last EncoderLoad / LMLoad
    outstanding: int = 0  # tokens the proxy sent and has not seen finish
    finished_since_load: int = 0  # tokens the proxy saw finish since that report arrived
    last_error: str = ""
    since: float = field(default_factory=time.time)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return self.status == "SERVING"

    def usable(self) -> bool:
        return self.up and self.breaker.allows()

    def sent(self, tokens: int) -> None:
        self.outstanding += tokens

    def finished(self, tokens: int, generated: int = 0) -> None:
        """Work sent here is done (or abandoned): `tokens` as counted by `sent`, plus the tokens
        it generated, which the worker's reports count as its own while it runs."""
        self.outstanding -= tokens
        self.finished_since_load += tokens + generated

    def set_load(self, load: Any) -> None:
        self.load = load
        self.finished_since_load = 0

    def queued_tokens(self) -> int:
        """The worker's last report, less what the proxy saw finish since, or the proxy's own
        count of work in flight there, whichever is larger.

        The report is up to one poll interval old: without taking off what finished since, a
        burst that arrives just after a busy report would avoid a worker that is already idle.
        """
        if self.load is None:
            return self.outstanding
        if self.role == "encoder":
            reported = self.load.queued_tokens
        else:
            reported = self.load.running_tokens + self.load.waiting_tokens
        return max(reported - self.finished_since_load, self.outstanding)


def least_loaded(workers: Iterable[Worker]) -> Worker | None:
    usable = [w for w in workers if w.usable()]
    return min(usable, key=lambda w: (w.queued_tokens(), w.address), default=None)


class WorkerPool:
    def __init__(
        self,
        role: str,  # "encoder" | "lm"
        stub_cls: Callable,
        static: tuple[str, ...],
        config,  # ClusterConfig
        redis_client=None,
        up_gauge: Gauge | None = None,
        circuit_gauge: Gauge | None = None,
    ):
        self.role = role
        self.stub_cls = stub_cls
        self.static = static
        self.config = config
        self.redis = redis_client
        self.workers: dict[str, Worker] = {}
        self.up_gauge = up_gauge
        self.circuit_gauge = circuit_gauge
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()  # channels of removed workers, closing
        self.changed = asyncio.Event()  # set whenever a worker comes up

    @functools.cached_property
    def token(self) -> str | None:
        """The cluster token every call to a worker carries: workers answer only the proxy."""
        return call_token(self.config.cluster)

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        for address in self.static:
            self._add(address, "static")
        if self.redis is not None and self.config.registry.enabled:
            await self._refresh()
            self._tasks.append(asyncio.create_task(self._discover(), name=f"{self.role}-discover"))
        self._tasks.append(asyncio.create_task(self._poll_load(), name=f"{self.role}-load"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in list(self.workers.values()):
            await self._remove(worker.address)
        for closing in list(self._closing):
            closing.cancel()
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)

    def _add(self, address: str, source: str) -> Worker:
        channel = cluster_aio_channel(address, self.config.cluster.tls, CHANNEL_OPTIONS, self.token)
        p = self.config.proxy
        worker = Worker(
            self.role,
            address,
            source,
            channel,
            self.stub_cls(channel),
            Breaker(p.circuit_failures, p.circuit_cooldown_seconds),
        )
        self.workers[address] = worker
        worker.tasks.append(asyncio.create_task(self._watch(worker), name=f"watch-{address}"))
        logger.info("%s %s added (%s)", self.role, address, source)
        self._export(worker)
        return worker

    async def _remove(self, address: str, grace: float | None = None) -> None:
        """Forget a worker. With `grace`, calls in flight on its channel may finish (or fail
        by keepalive) for that long before the channel is closed under them."""
        worker = self.workers.pop(address, None)
        if worker is None:
            return
        for task in worker.tasks:
            task.cancel()
        await asyncio.gather(*worker.tasks, return_exceptions=True)
        if grace is None:
            await worker.channel.close()
        else:
            closing = asyncio.create_task(worker.channel.close(grace=grace))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if self.up_gauge is not None:
            self.up_gauge.labels(self.role, address).set(0)
        logger.info("%s %s removed", self.role, address)

    # -- choosing -----------------------------------------------------------------------------

    def usable(self, exclude: set[str] = frozenset()) -> list[Worker]:
        """The workers that may take work now, less those in `exclude` (addresses)."""
        return [w for w in self.workers.values() if w.usable() and w.address not in exclude]

    def pick(self, exclude: set[str] = frozenset()) -> Worker | None:
        """The usable worker with the least queued work (none: None)."""
        return least_loaded(self.usable(exclude))

    async def wait_for(self, choose: Callable[[], Any], wait: float) -> Any:
        """What `choose()` gives once it gives something, waiting up to `wait` seconds for a
        worker to come up (a restart, a registration, a proxy that started before its workers
        listened); None when nothing came."""
        deadline = time.monotonic() + wait
        while not (found := choose()):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return found

    def failed(self, worker: Worker, error: str) -> None:
        worker.breaker.failure()
        worker.last_error = error
        self._export(worker)

    def succeeded(self, worker: Worker) -> None:
        if worker.breaker.state is not Circuit.CLOSED:
            worker.breaker.success()
            self._export(worker)
        else:
            worker.breaker.success()

    def summary(self) -> str:
        """healthy (every worker up) / degraded (some) / unavailable (none)."""
        up = sum(w.up for w in self.workers.values())
        if up == 0:
            return "unavailable"
        return "healthy" if up == len(self.workers) else "degraded"

    # -- background ---------------------------------------------------------------------------

    async def _watch(self, worker: Worker) -> None:
        """Follow the worker's health; a broken stream means it is unreachable."""
        stub = health_pb2_grpc.HealthStub(worker.channel)
        delay = 0.05
        while True:
            try:
                stream = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                async for reply in stream:
                    self._set_status(
                        worker, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    )
                    delay = 0.05
            except grpc.aio.AioRpcError as e:
                worker.last_error = f"health watch: {e.code().name}"
            self._set_status(worker, "UNREACHABLE")
            # Retry soon: while the channel is down the call fails at once, without a packet
            # sent, and a worker back up should be seen well within wait_for's 2 s.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _set_status(self, worker: Worker, status: str) -> None:
        if status != worker.status:
            logger.info("%s %s: %s -> %s", self.role, worker.address, worker.status, status)
            worker.status = status
            worker.since = time.time()
            if status == "SERVING":
                worker.breaker.success()
                self.changed.set()
            self._export(worker)

    async def _poll_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.proxy.load_poll_seconds)
            await asyncio.gather(*(self._load_of(w) for w in list(self.workers.values()) if w.up))

    async def _load_of(self, worker: Worker) -> None:
        # A failed poll changes nothing: the health watch and call failures decide availability.
        with contextlib.suppress(grpc.aio.AioRpcError):
            worker.set_load(await worker.stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=1.0))

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.registry.heartbeat_seconds, 0.5))
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            live = await live_workers(
                self.redis,
                self.config.connector.namespace,
                self.role,
                self.config.registry.ttl_seconds,
            )
        except redis.RedisError as e:
            logger.warning("registry read failed (%s); keeping the workers known", e)
            return
        for address in live - set(self.workers):
            self._add(address, "registry")
        for worker in list(self.workers.values()):
            if worker.source == "registry" and worker.address not in live:
                await self._remove(worker.address, grace=self.config.proxy.request_timeout_seconds)

    def _export(self, worker: Worker) -> None:
        if self.up_gauge is not None:
            self.up_gauge.labels(self.role, worker.address).set(1 if worker.up else 0)
        if self.circuit_gauge is not None:
            is_open = worker.breaker.state is Circuit.OPEN
            self.circuit_gauge.labels(self.role, worker.address).set(1 if is_open else 0)


def overall_status(lms: WorkerPool, encoders: WorkerPool) -> str:
    """The cluster as the proxy sees it: unavailable without an LM worker (nothing can be
    served), healthy when every worker is up, degraded otherwise (text-only requests need just
    an LM worker; media needs an encoder too)."""
    lm, enc = lms.summary(), encoders.summary()
    if lm == "unavailable":
        return "unavailable"
    return "healthy" if lm == enc == "healthy" else "degraded"
