"""The EC connector: encoder outputs in Redis, keyed by content (mm_hash), never by request.

    encoder workers ──put──▶ Redis ◀──has_many── proxy
                                  ◀──get_many / wait_for── LM workers (local hot tier in front)

Key schema: `{namespace}:ec:{model fingerprint}:{{mm_hash}}`. The fingerprint changes with
anything that changes an embedding (checkpoint, tower dtype, processor config), so two models or
two dtypes never share entries. The mm_hash sits in a Redis Cluster hash tag, so entries spread
over the nodes and a request's items are fetched with one pipeline per node.

Every put is `SET key value NX EX ttl` (stored once however many encoders race) pipelined with a
notification that wakes `wait_for` in every consumer (connector/arrivals.py):

    standalone  PUBLISH  {namespace}:ec:{fingerprint}:published          payload: the mm_hash
    cluster     SPUBLISH {namespace}:ec:{fingerprint}:published:{{mm_hash}} payload: the mm_hash

In cluster mode the channel carries the entry's hash tag, so it lives in the entry's slot: the
SET and the SPUBLISH go to the one shard that holds the entry, and the notification travels
only inside that shard; a waiter subscribes (SSUBSCRIBE) on the shards of the hashes it waits
for. Reads and existence checks are pipelined per node (redis-py's cluster pipeline writes to
every node before reading any reply); MOVED / ASK and failovers are followed by the client, and
an entry on a master that is unreachable is a miss, never an error.
A miss is a normal outcome (TTL expiry, eviction under maxmemory, a flushed or restarted Redis):
the caller re-encodes. A corrupt value is counted, logged, deleted and reported as a miss.

This module is the blocking flavour, `ECConnector`, and the pieces the asyncio flavour
(`AsyncECConnector`, connector/ec_async.py) shares with it: key schema, error mapping, local-tier
bookkeeping, the asyncio existence check and the choice of arrival notifier. Both flavours have
the same methods; the asyncio one moves entries through this one in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from connector import wire
from connector.arrivals import ArrivalNotifier, Notifier, ShardedNotifier, wait_for_arrivals
from connector.client import Mode, async_client, redact_url, sync_client
from connector.local_tier import LocalTier
from connector.metrics import ConnectorMetrics
from connector.resp import fetch_bulk

logger = logging.getLogger(__name__)

_HASH_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


# What a cluster in motion answers (a master lost, a failover under way, slots moving): the
# entries concerned are misses for now, never an error.
_TOPOLOGY_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    redis.exceptions.TryAgainError,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
)


def _is_topology_error(e: Exception) -> bool:
    credentials = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
    return isinstance(e, _TOPOLOGY_ERRORS) and not isinstance(e, credentials)


class ConnectorError(RuntimeError):
    """Redis could not do what was asked (unreachable after retries, or refused the command).
    The message names the (redacted) URL and the cause; `kind` says which: "connection" or
    "timeout" (no answer: worth another try) or "response" (Redis answered with an error)."""

    def __init__(self, message: str, kind: str = "response"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PutResult:
    mm_hash: str
    stored: bool  # False: the cache already held this hash; nothing was written
    nbytes: int


class ECConnector:
    """The blocking flavour: every operation, in the caller's thread."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        namespace: str = "epd",
        ttl_seconds: int = 3600,
        local_tier_bytes: int = 0,
        registry: CollectorRegistry | None = REGISTRY,
        op_timeout: float = 5.0,
        retries: int = 3,
        mode: Mode = "standalone",
    ):
        if not _HASH_RE.match(fingerprint):
            raise ValueError(f"model fingerprint {fingerprint!r} is not a short token")
        if mode not in ("standalone", "cluster"):
            raise ValueError(f"mode must be standalone or cluster, got {mode!r}")
        self.url = url
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.op_timeout = op_timeout
        self.retries = retries
        self.mode = mode
        self.cluster = mode == "cluster"
        self.prefix = f"{namespace}:ec:{fingerprint}:"
        self.channel = f"{namespace}:ec:{fingerprint}:published"
        self.local = LocalTier(local_tier_bytes) if local_tier_bytes > 0 else None
        self.metrics = ConnectorMetrics(registry)
        self.client = sync_client(url, op_timeout, retries, mode)
        # The strategy is chosen once: the standalone path is the one it always was.
        self._publish = self._spublish if self.cluster else self._publish_one_channel
        self._fetch = self._fetch_per_node if self.cluster else self._fetch_mget

    def close(self) -> None:
        self.client.close()

    def key(self, mm_hash: str) -> str:
        if not _HASH_RE.match(mm_hash):
            raise ValueError(f"mm_hash {mm_hash!r} must be 1-128 characters of [A-Za-z0-9_.-]")
        return f"{self.prefix}{{{mm_hash}}}"

    def shard_channel(self, mm_hash: str) -> str:
        """Cluster mode: the channel announcing `mm_hash`, in the slot of its entry."""
        return f"{self.channel}:{{{mm_hash}}}"

    def mark_key(self, mm_hash: str) -> str:
        """The "being encoded" mark of `mm_hash` (single flight across proxies), next to its
        entry: the same hash tag, so the same slot and shard."""
        self.key(mm_hash)  # validates
        return f"{self.prefix}encoding:{{{mm_hash}}}"

    # -- operations ---------------------------------------------------------------------------

    def put(self, mm_hash: str, tensor: torch.Tensor) -> PutResult:
        """Store `tensor` under `mm_hash` unless the cache already holds it (then nothing is
        written and `stored` is False). Wakes every `wait_for` on this hash."""
        started = time.perf_counter()
        key, value = self.key(mm_hash), wire.encode(tensor)
        delay = 0.05
        while True:
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.set(key, value, nx=True, ex=self.ttl_seconds)
                self._publish(pipe, mm_hash)
                stored = bool(pipe.execute()[0])
                break
            except redis.RedisError as e:
                if self._may_wait_for_failover(e, started):
                    # The entry's master is down and its replica not promoted yet: a put has
                    # nowhere else to go, so it waits (bounded) for the new master.
                    logger.info("put %s: waiting for the cluster to fail over (%s)", mm_hash, e)
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                self.metrics.puts.labels("failed").inc()
                raise self.error(e, f"put {mm_hash}") from e
        self.metrics.puts.labels("stored" if stored else "held").inc()
        if stored:
            self.metrics.bytes_out.inc(len(value))
        self.metrics.put_seconds.observe(time.perf_counter() - started)
        return PutResult(mm_hash, stored, len(value))

    def has_many(self, hashes: Sequence[str]) -> list[bool]:
        """Which hashes the cache holds (local tier, then one round trip to Redis)."""
        local, rest = self.split_local("has", hashes)
        return self.merge_has(hashes, local, rest, self._exists(rest) if rest else [])

    def get_many(self, hashes: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """-> ({hash: tensor} for the hashes held, [the misses]). Local tier first, then one
        MGET. Tensors are read-only views: never write into them."""
        started = time.perf_counter()
        found, rest = self.split_local("get", hashes)
        misses: list[str] = []
        if rest:
            fetched, misses = self.fetch_many(rest)
            found.update(fetched)
        self.metrics.get_seconds.observe(time.perf_counter() - started)
        return found, misses

    def fetch_many(self, hashes: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """get_many's Redis half, for hashes the local tier was asked for already: one MGET;
        what it finds goes into the local tier."""
        values = self._fetch(list(hashes))
        fetched, misses, corrupt = self._decode_values(list(hashes), values)
        if corrupt:
            self._delete_keys(corrupt)
        return fetched, misses

    def wait_for(self, hashes: Sequence[str], timeout: float) -> set[str]:
        """Block until every hash is held or `timeout` seconds pass; woken by the publish of
        each put, never by polling. Returns the hashes still missing (empty: all held)."""
        if self.cluster:
            return asyncio.run(self._wait_sharded(hashes, timeout))
        deadline = time.monotonic() + timeout
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            # The subscription is live once confirmed; check what is already there after that.
            if pubsub.get_message(timeout=max(deadline - time.monotonic(), 0)) is None:
                return set(hashes)
            rest = self._not_in_local(hashes)
            pending = {h for h, held in zip(rest, self._exists(rest), strict=True) if not held}
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining)
                if message is not None and message["type"] == "message":
                    self.metrics.notifications.inc()
                    pending.discard(message["data"].decode())
            return pending
        except redis.RedisError as e:
            raise self.error(e, "wait_for") from e
        finally:
            pubsub.close()

    async def _wait_sharded(self, hashes: Sequence[str], timeout: float) -> set[str]:
        """Cluster mode, for blocking callers (tools, tests): the asyncio waiter on a private
        event loop and client (a subscription per shard cannot be read from one socket)."""
        client = async_client(self.url, self.op_timeout, self.retries, self.mode)
        notifier = self.arrival_notifier(client)
        try:
            return await wait_for_arrivals(
                notifier, hashes, timeout, partial(self.missing_async, client)
            )
        finally:
            await notifier.close()
            await client.aclose()

    def delete(self, hashes: Sequence[str]) -> int:
        if self.local is not None:
            for h in hashes:
                self.local.discard(h)
            self.metrics.local_bytes.set(self.local.nbytes)
        return self._delete_keys([self.key(h) for h in hashes])

    # -- pieces the asyncio flavour (connector/ec_async.py) shares ------------------------------

    def error(self, e: redis.RedisError, op: str) -> ConnectorError:
        """Count `e` and return the ConnectorError naming `op`, the (redacted) URL and the
        cause; the caller raises it (or only counts it, for an error it recovers from)."""
        if isinstance(e, redis.ConnectionError):
            kind, what = "connection", "is unreachable"
        elif isinstance(e, redis.TimeoutError):
            kind, what = "timeout", "timed out"
        else:
            kind, what = "response", "refused the command"
        self.metrics.redis_errors.labels(kind).inc()
        return ConnectorError(f"{op}: Redis at {redact_url(self.url)} {what}: {e}", kind)

    def split_local(self, op: str, hashes: Sequence[str]) -> tuple[dict, list[str]]:
        """The hashes the local tier holds (with their tensors), and the rest. Counted."""
        if self.local is None:
            return {}, list(hashes)
        found, rest = {}, []
        for h in hashes:
            tensor = self.local.get(h)
            if tensor is not None:
                found[h] = tensor
            else:
                rest.append(h)
        self.metrics.hit[op, "local"].inc(len(found))
        self.metrics.miss[op, "local"].inc(len(rest))
        return found, rest

    def merge_has(
        self, hashes: Sequence[str], local: dict, rest: list[str], exists: list[bool]
    ) -> list[bool]:
        """has_many's answer, in the order of `hashes`, from `split_local`'s two parts and
        whether Redis holds each of `rest`. Counts the Redis hits and misses."""
        held = dict.fromkeys(local, True)
        held.update(zip(rest, exists, strict=True))
        hits = sum(exists)
        self.metrics.hit["has", "redis"].inc(hits)
        self.metrics.miss["has", "redis"].inc(len(rest) - hits)
        return [held[h] for h in hashes]

    def arrival_notifier(self, client: aioredis.Redis | aiocluster.RedisCluster) -> ArrivalNotifier:
        """The notifier for this store's channels, subscribing through the asyncio `client`:
        one channel (standalone) or a shard channel per hash (cluster)."""
        if self.cluster:
            return ShardedNotifier(client, self.shard_channel, self.metrics)
        return Notifier(client, self.channel, self.metrics)

    async def missing_async(
        self, client: aioredis.Redis | aiocluster.RedisCluster, hashes: Iterable[str]
    ) -> set[str]:
        """Uncounted, for waiters: the hashes neither the local tier nor Redis (asked through
        the asyncio `client`) holds."""
        rest = self._not_in_local(hashes)
        held = await self.exists_async(client, rest) if rest else []
        return {h for h, ok in zip(rest, held, strict=True) if not ok}

    async def exists_async(
        self, client: aioredis.Redis | aiocluster.RedisCluster, hashes: Sequence[str]
    ) -> list[bool]:
        """EXISTS per hash through the asyncio `client`, in one pipeline (per node in cluster
        mode, all nodes at once). In cluster mode, if the cluster cannot answer as a whole,
        each hash is asked on its own and the ones on an unreachable master are reported
        absent."""
        try:
            pipe = client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(n) for n in await pipe.execute()]
        except (redis.RedisError, AttributeError) as e:
            # NOTE: redis-py 8.1's asyncio cluster pipeline can write to a connection that a
            # concurrent slot-map refresh is tearing down ('NoneType' object has no attribute
            # 'writelines'): a lost connection, like the topology errors.
            lost = isinstance(e, AttributeError) or _is_topology_error(e)
            if not (self.cluster and lost):
                raise self.error(e, "has_many") from e
            if isinstance(e, redis.RedisError):
                self.error(e, "has_many")
            logger.warning("has_many: the cluster did not answer as a whole (%r); key by key", e)
        # Up to three passes: the first failures make the client refresh its slot map, which
        # may fail commands to healthy masters that were under way meanwhile.
        answers: list = [None] * len(hashes)
        for attempt in range(3):
            todo = [i for i, a in enumerate(answers) if a is None or isinstance(a, Exception)]
            if not todo:
                break
            if attempt:
                await asyncio.sleep(0.05 * attempt)  # let the slot-map refresh settle
            got = await asyncio.gather(
                *(client.exists(self.key(hashes[i])) for i in todo), return_exceptions=True
            )
            for i, a in zip(todo, got, strict=True):
                if isinstance(a, redis.RedisError) and not _is_topology_error(a):
                    raise self.error(a, "has_many") from a
                if isinstance(a, Exception) and not isinstance(
                    a, redis.RedisError | AttributeError
                ):
                    raise a
                answers[i] = a
        return [a is not None and not isinstance(a, Exception) and bool(a) for a in answers]

    # -- pieces of the operations ----------------------------------------------------------------

    def _may_wait_for_failover(self, e: redis.RedisError, started: float) -> bool:
        """Cluster mode: a topology error within op_timeout x (retries + 1) of the start (about
        what a failover takes with a node timeout of a few seconds)."""
        if not (self.cluster and _is_topology_error(e)):
            return False
        self.error(e, "put")  # counted
        patience = self.op_timeout * (self.retries + 1)
        return time.perf_counter() - started < patience

    def _publish_one_channel(self, pipe, mm_hash: str) -> None:
        pipe.publish(self.channel, mm_hash)

    def _spublish(self, pipe, mm_hash: str) -> None:
        pipe.spublish(self.shard_channel(mm_hash), mm_hash)

    def _fetch_mget(self, hashes: list[str]) -> list[memoryview | None]:
        """Standalone: one GET (one entry) or MGET, each value received into a buffer of its
        own (connector/resp.py: no parser copies)."""
        try:
            if len(hashes) == 1:  # a plain GET: no array reply to parse
                return fetch_bulk(self.client, "GET", self.key(hashes[0]))
            return fetch_bulk(self.client, "MGET", *[self.key(h) for h in hashes])
        except redis.RedisError as e:
            raise self.error(e, "get_many") from e

    def _fetch_per_node(self, hashes: list[str]) -> list[bytes | None]:
        """Cluster mode: one GET per entry, pipelined per node (all nodes written before any
        is read). Entries on a node that cannot be reached come back as misses."""
        return self._per_node("get_many", "get", hashes, None)

    def _per_node(self, op: str, command: str, hashes: Sequence[str], absent):
        """Run `command` on every hash's key through a cluster pipeline; if the cluster cannot
        answer as a whole (a master is down and its replica not promoted yet), retry node by
        node and report the hashes of the nodes that fail as `absent`."""
        keys = [self.key(h) for h in hashes]
        try:
            if len(keys) == 1:  # one entry: the plain command, without the pipeline's routing
                return [getattr(self.client, command)(keys[0])]
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                getattr(pipe, command)(k)
            return pipe.execute()
        except redis.RedisError as e:
            if not _is_topology_error(e):
                raise self.error(e, op) from e
            self.error(e, op)  # counted and logged below
            logger.warning("%s: the cluster did not answer as a whole (%s); node by node", op, e)
        by_node: dict[str, list[int]] = defaultdict(list)
        out = [absent] * len(keys)
        try:
            nodes = {}
            for i, k in enumerate(keys):
                node = self.client.get_node_from_key(k)
                nodes[node.name] = node
                by_node[node.name].append(i)
        except redis.RedisError as e:  # slots not covered: every entry is a miss
            logger.warning("%s: no slot map (%s); reporting misses", op, e)
            return out
        for name, indices in by_node.items():
            try:
                node_pipe = nodes[name].redis_connection.pipeline(transaction=False)
                for i in indices:
                    getattr(node_pipe, command)(keys[i])
                for i, value in zip(indices, node_pipe.execute(), strict=True):
                    out[i] = value
            except redis.RedisError as e:
                self.error(e, op)
                logger.warning(
                    "%s: node %s is unreachable (%s): %d misses", op, name, e, len(indices)
                )
        return out

    def _exists(self, hashes: Sequence[str]) -> list[bool]:
        if self.cluster:
            return [bool(n) for n in self._per_node("has_many", "exists", hashes, 0)]
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as e:
            raise self.error(e, "has_many") from e

    def _delete_keys(self, keys: list[str]) -> int:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(k)
            return sum(pipe.execute())
        except redis.RedisError as e:
            raise self.error(e, "delete") from e

    def _not_in_local(self, hashes: Iterable[str]) -> list[str]:
        """Uncounted, for waiters: the hashes the local tier does not hold."""
        return [h for h in hashes if self.local is None or h not in self.local]

    def _decode_values(
        self, hashes: list[str], values: list[bytes | memoryview | None]
    ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """-> (found, misses, keys of corrupt entries to delete). Never raises on bad data."""
        found, misses, corrupt = {}, [], []
        nbytes = 0
        for h, value in zip(hashes, values, strict=True):
            if value is None:
                misses.append(h)
                continue
            nbytes += len(value)
            try:
                tensor = wire.decode(value)
            except wire.WireError as e:
                logger.warning("corrupt entry %s (%s): deleting it, treating it as a miss", h, e)
                self.metrics.corrupt.inc()
                corrupt.append(self.key(h))
                misses.append(h)
                continue
            found[h] = tensor
            if self.local is not None:
                self.local.put(h, tensor)
        # Counters only where they move: each inc takes a lock, on every fetch.
        if nbytes:
            self.metrics.bytes_in.inc(nbytes)
        if found:
            self.metrics.hit["get", "redis"].inc(len(found))
        if misses:
            self.metrics.miss["get", "redis"].inc(len(misses))
        if self.local is not None:
            self.metrics.local_bytes.set(self.local.nbytes)
        return found, misses, corrupt
