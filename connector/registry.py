"""Worker registration through Redis: workers come and go without a proxy restart.

A SERVING worker announces itself every `heartbeat_seconds` in a sorted set per role (one key,
so one slot and one shard in cluster mode),

    {namespace}:registry:{role}  member = the address the proxy should dial, score = unix ms

and leaves it when it starts draining. The proxy reads the members whose last heartbeat is
younger than `ttl_seconds`: a new worker is routed to within a heartbeat, a dead one drops out
after the TTL (the proxy's health watch usually notices sooner).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis
import redis.asyncio as aioredis

from connector.client import Mode, async_client

logger = logging.getLogger(__name__)


def registry_key(namespace: str, role: str) -> str:
    return f"{namespace}:registry:{role}"


def restarts_key(namespace: str) -> str:
    """A hash, role name -> JSON {"restarts", "last", "reason", "exit_code", "deaths" (within
    "window_seconds"), "backed_off", "state" ("waiting" | "starting" | "serving"), "until" (the
    next restart, unix seconds, or null), "cannot_run"}: what `epd up`'s supervisor did (the
    dashboard shows it)."""
    return f"{namespace}:restarts"


class Heartbeat:
    """A worker's announcement loop (started once SERVING, stopped when draining)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        role: str,
        address: str,
        interval: float,
        mode: Mode = "standalone",
    ):
        self.key = registry_key(namespace, role)
        self.address = address
        self.interval = interval
        self.client: aioredis.Redis = async_client(url, retries=0, mode=mode)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._beat()
        self.task = asyncio.create_task(self._run(), name="registry-heartbeat")
        logger.info("registered as %s in %s", self.address, self.key)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        try:
            await self.client.zrem(self.key, self.address)
        except redis.RedisError as e:
            logger.warning("could not deregister %s: %s", self.address, e)
        await self.client.aclose()

    async def _beat(self) -> None:
        await self.client.zadd(self.key, {self.address: int(time.time() * 1000)})

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._beat()
            except redis.RedisError as e:  # Redis away: keep trying, the TTL covers the gap
                logger.warning("heartbeat to the registry failed: %s", e)


async def live_workers(client: aioredis.Redis, namespace: str, role: str, ttl: float) -> set[str]:
    """Addresses whose heartbeat is younger than `ttl` seconds; prunes long-dead ones."""
    key = registry_key(namespace, role)
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(key, now_ms - int(ttl * 1000), "+inf")
    pipe.zremrangebyscore(key, "-inf", now_ms - int(60 * ttl * 1000))
    members, _ = await pipe.execute()
    return {m.decode() if isinstance(m, bytes) else m for m in members}
