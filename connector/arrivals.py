"""Arrival notification: wakes whoever waits for an EC entry when its put is published.

    put ──PUBLISH / SPUBLISH──▶ Redis ──message──▶ Notifier / ShardedNotifier ──wake──▶ Waiter
                                                           (re)subscribed ──recheck──▶ Waiter
    wait_for_arrivals: register a Waiter, then sleep on its event; each recheck asks the
    store's `missing` callback which hashes are still absent, each message crosses one off.

A notifier holds one subscription (standalone) or one per master (cluster) for all the waiters
of its store, however many there are. A publish sent while a subscription was not live is never
delivered, so every confirmed (re)subscription makes the waiters concerned re-check Redis; that,
not polling, is what makes a lost message harmless. The notifiers know channels, never keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster

from connector.metrics import ConnectorMetrics

logger = logging.getLogger(__name__)


class Waiter:
    """One `wait_for` call: the hashes it waits for, those still pending, and its wake-up."""

    def __init__(self, hashes: set[str]):
        self.hashes = frozenset(hashes)
        self.pending = set(hashes)
        self.wake = asyncio.Event()
        self.recheck = True  # check Redis before the first wait


class ArrivalNotifier(Protocol):
    """What `wait_for_arrivals` needs of a notifier."""

    async def ready(self, timeout: float) -> bool: ...

    async def register(self, hashes: set[str]) -> Waiter: ...

    def unregister(self, waiter: Waiter) -> None: ...

    async def close(self) -> None: ...


async def wait_for_arrivals(
    notifier: ArrivalNotifier,
    hashes: Sequence[str],
    timeout: float,
    missing: Callable[[list[str]], Awaitable[set[str]]],
) -> set[str]:
    """Wait until every hash has arrived or `timeout` seconds pass; `missing(hashes)` answers
    which of `hashes` the store does not hold (asked on registration and after each
    resubscription). Returns the hashes still missing (empty: all held)."""
    deadline = time.monotonic() + timeout
    waiter = await notifier.register(set(hashes))
    try:
        if not await notifier.ready(timeout):
            return set(waiter.pending)
        while True:
            if waiter.recheck:
                waiter.recheck = False
                # Messages delivered during the check stay crossed off.
                waiter.pending &= await missing(list(waiter.pending))
            if not waiter.pending:
                return set()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return set(waiter.pending)
            try:
                await asyncio.wait_for(waiter.wake.wait(), remaining)
            except TimeoutError:
                return set(waiter.pending)
            waiter.wake.clear()
    finally:
        notifier.unregister(waiter)


class Notifier:
    """Standalone: one subscription to the publish channel per connector, shared by all its
    waiters.

    After every (re)subscription the waiters re-check Redis: a publish sent while the
    subscription was down is never delivered."""

    def __init__(self, client: aioredis.Redis, channel: str, metrics: ConnectorMetrics):
        self.client = client
        self.channel = channel
        self.metrics = metrics
        self.by_hash: dict[str, set[Waiter]] = defaultdict(set)
        self.waiters: set[Waiter] = set()
        self.subscribed = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def ready(self, timeout: float) -> bool:
        """Whether the subscription is live (within `timeout` seconds)."""
        try:
            await asyncio.wait_for(self.subscribed.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def register(self, hashes: set[str]) -> Waiter:
        waiter = Waiter(hashes)
        self.waiters.add(waiter)
        for h in hashes:
            self.by_hash[h].add(waiter)
        if self.task is None:
            self.task = asyncio.create_task(self._listen(), name="ec-notifier")
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        self.waiters.discard(waiter)
        for h in waiter.hashes:
            listeners = self.by_hash.get(h)
            if listeners is not None:
                listeners.discard(waiter)
                if not listeners:
                    del self.by_hash[h]

    async def _listen(self) -> None:
        delay = 0.05
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                async for message in pubsub.listen():
                    if message["type"] == "subscribe":
                        delay = 0.05
                        self.subscribed.set()
                        for waiter in self.waiters:
                            waiter.recheck = True
                            waiter.wake.set()
                    elif message["type"] == "message":
                        self._delivered(message["data"].decode())
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                self.subscribed.clear()
                logger.warning("notification subscription lost (%s); resubscribing", e)
                self.metrics.redis_errors.labels("connection").inc()
                await asyncio.sleep(delay)  # reconnect backoff, not a poll for entries
                delay = min(delay * 2, 1.0)
            finally:
                await pubsub.aclose()

    def _delivered(self, h: str) -> None:
        self.metrics.notifications.inc()
        for waiter in self.by_hash.get(h, ()):
            waiter.pending.discard(h)
            waiter.wake.set()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None


class _ShardListener:
    """One pubsub connection to one master, and the task reading it."""

    def __init__(self, node: aiocluster.ClusterNode):
        self.name = node.name
        pool = aioredis.ConnectionPool(
            connection_class=node.connection_class, **node.connection_kwargs
        )
        self.client = aioredis.Redis(connection_pool=pool)
        self.pubsub = self.client.pubsub()
        self.task: asyncio.Task | None = None
        # One command at a time: the first one opens the connection, and two first commands
        # racing would open two.
        self.lock = asyncio.Lock()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.pubsub.aclose()
        await self.client.aclose()


class ShardedNotifier:
    """Cluster mode: every hash waited for has its own shard channel, in its entry's slot;
    one pubsub connection per master holding such a channel, each read by its own task.

    A confirmed SSUBSCRIBE makes the hash's waiters re-check Redis (a publish sent before the
    subscription was live is never delivered). A connection lost (a master died) or a
    subscription the server dropped (its slot moved) sends the hashes concerned to a repair
    task: it refreshes the slot map and subscribes them again on their current owners."""

    def __init__(
        self,
        client: aiocluster.RedisCluster,
        channel_of: Callable[[str], str],
        metrics: ConnectorMetrics,
    ):
        self.client = client
        self.channel_of = channel_of
        self.metrics = metrics
        self.by_hash: dict[str, set[Waiter]] = defaultdict(set)
        self.hash_of: dict[bytes, str] = {}  # channel name -> mm_hash
        self.where: dict[str, str] = {}  # mm_hash -> name of the node it is subscribed on
        self.listeners: dict[str, _ShardListener] = {}
        self.repair_task: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()

    async def ready(self, timeout: float) -> bool:
        return True  # each hash's confirmation triggers its own re-check

    async def register(self, hashes: set[str]) -> Waiter:
        waiter = Waiter(hashes)
        new = [h for h in hashes if h not in self.by_hash]
        for h in hashes:
            self.by_hash[h].add(waiter)
        for h in new:
            if not await self._subscribe(h):
                self._repair_soon()
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        for h in waiter.hashes:
            listeners = self.by_hash.get(h)
            if listeners is None:
                continue
            listeners.discard(waiter)
            if listeners:
                continue
            del self.by_hash[h]
            listener = self.listeners.get(self.where.pop(h, ""))
            if listener is not None:  # best effort: a dropped subscription is only traffic
                self._spawn(self._unsubscribe(listener, self.channel_of(h)))

    async def _subscribe(self, h: str) -> bool:
        channel = self.channel_of(h)
        try:
            await self.client.initialize()
            node = self.client.get_node_from_key(channel)
            listener = self.listeners.get(node.name)
            if listener is None:
                listener = self.listeners[node.name] = _ShardListener(node)
            self.hash_of[channel.encode()] = h
            async with listener.lock:
                await listener.pubsub.ssubscribe(channel)
            if listener.task is None:
                listener.task = asyncio.create_task(self._read(listener), name="ec-shard-reader")
            if h not in self.by_hash:  # its waiters left while it was being subscribed
                self._spawn(self._unsubscribe(listener, channel))
                return True
            self.where[h] = node.name
            return True
        except (redis.RedisError, OSError) as e:
            logger.warning("could not subscribe to %s (%s); retrying", channel, e)
            self.metrics.redis_errors.labels("connection").inc()
            return False

    async def _unsubscribe(self, listener: _ShardListener, channel: str) -> None:
        try:
            async with listener.lock:
                await listener.pubsub.sunsubscribe(channel)
        except (redis.RedisError, OSError) as e:
            logger.debug("sunsubscribe %s: %s", channel, e)

    async def _read(self, listener: _ShardListener) -> None:
        try:
            while True:
                message = await listener.pubsub.get_message(timeout=None)
                if message is not None:
                    self._on_message(listener, message)
        except (redis.RedisError, OSError) as e:
            logger.warning("shard subscription to %s lost (%s); moving it", listener.name, e)
            self.metrics.redis_errors.labels("connection").inc()
            if self.listeners.get(listener.name) is listener:
                del self.listeners[listener.name]
            for h, name in list(self.where.items()):
                if name == listener.name:
                    del self.where[h]
            listener.task = None
            self._spawn(listener.close())
            self._repair_soon()

    def _on_message(self, listener: _ShardListener, message: dict) -> None:
        kind = message["type"]
        if kind == "smessage":
            self.metrics.notifications.inc()
            h = message["data"].decode()
            for waiter in self.by_hash.get(h, ()):
                waiter.pending.discard(h)
                waiter.wake.set()
            return
        h = self.hash_of.get(message["channel"])
        if h is None:
            return
        if kind == "ssubscribe":
            for waiter in self.by_hash.get(h, ()):
                waiter.recheck = True
                waiter.wake.set()
        elif kind == "sunsubscribe":
            if h not in self.by_hash:
                self.hash_of.pop(message["channel"], None)
            elif self.where.get(h) == listener.name:
                # Dropped by the server (its slot moved) or raced by our own unsubscribe.
                del self.where[h]
                self._repair_soon()

    def _repair_soon(self) -> None:
        if self.repair_task is None or self.repair_task.done():
            self.repair_task = asyncio.create_task(self._repair(), name="ec-shard-repair")

    async def _repair(self) -> None:
        delay = 0.05
        while True:
            missing = [h for h in self.by_hash if h not in self.where]
            if not missing:
                return
            await asyncio.sleep(delay)  # reconnect backoff, not a poll for entries
            delay = min(delay * 2, 1.0)
            try:
                await self.client.nodes_manager.initialize()  # a fresh slot map
            except (redis.RedisError, OSError) as e:
                logger.warning("cluster slot map refresh failed: %s", e)
                continue
            for h in missing:
                if h in self.by_hash and h not in self.where:
                    await self._subscribe(h)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        tasks = [t for t in (self.repair_task, *self.tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for listener in list(self.listeners.values()):
            await listener.close()
        self.listeners.clear()
