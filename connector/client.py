"""Connections to the Redis the cluster shares: URL handling and the start-up reachability wait.

Two modes, chosen once from the configuration: `standalone` (one server, or a primary behind a
fixed address) and `cluster` (Redis Cluster / Valkey cluster: the URL names any node, the client
discovers the rest, follows MOVED / ASK redirections and refreshes its slot map after a
failover)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)


Mode = Literal["standalone", "cluster"]

# The blocking client moves whole embeddings (0.25-16 MiB): reading the socket 1 MiB at a time
# instead of redis-py's 64 KiB takes a quarter MiB entry in one read, where each extra read is
# a system call, a parser feed and, on a busy host, a wake-up (a 0.25 MiB GET: ~20% faster).
READ_BYTES = 1 << 20
MODES: tuple[str, ...] = ("standalone", "cluster")


class RedisUnavailable(ConnectionError):
    """Redis did not answer; the message names the (redacted) URL and the last error."""


def redact_url(url: str) -> str:
    """The URL with its password replaced by '***', fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _retry(retries: int, asyncio_flavour: bool):
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=1.0)
    if asyncio_flavour:
        return AsyncRetry(backoff, retries)
    return Retry(backoff, retries)


def client_kwargs(op_timeout: float, retries: int, asyncio_flavour: bool) -> dict:
    """Timeouts and bounded retries with jittered exponential backoff for transient errors
    (connection resets, timeouts): a restarted Redis is reconnected to on the next command."""
    return {
        "socket_timeout": op_timeout,
        "socket_connect_timeout": min(op_timeout, 2.0),
        "retry": _retry(retries, asyncio_flavour),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": 30,
    }


def _cluster_kwargs(op_timeout: float, retries: int, asyncio_flavour: bool) -> dict:
    """A cluster client retries a command itself (refreshing its slot map on a connection
    error, following redirections); its nodes' connections do not retry underneath it.
    `require_full_coverage=False`: while a failed master's slots wait for its replica, the
    other masters keep serving (an entry on the lost master is a miss, not an error)."""
    kwargs = client_kwargs(op_timeout, 0, asyncio_flavour)
    del kwargs["retry_on_error"]
    kwargs["retry"] = _retry(max(retries, 1), asyncio_flavour)
    kwargs["require_full_coverage"] = False
    return kwargs


def sync_client(
    url: str, op_timeout: float = 5.0, retries: int = 3, mode: Mode = "standalone"
) -> redis.Redis | redis.cluster.RedisCluster:
    """A blocking client. rediss:// gets TLS (ssl_ca_certs=..., ssl_cert_reqs=... may follow
    in the query string); user:password@ authenticates as an ACL user. In cluster mode the
    URL is a seed node (connecting reads the slot map, so the cluster must answer)."""
    if mode == "cluster":
        kwargs = _cluster_kwargs(op_timeout, retries, False)
    else:
        kwargs = client_kwargs(op_timeout, retries, False)
    return (redis.cluster.RedisCluster if mode == "cluster" else redis.Redis).from_url(
        url, socket_read_size=READ_BYTES, **kwargs
    )


def async_client(
    url: str, op_timeout: float = 5.0, retries: int = 3, mode: Mode = "standalone"
) -> aioredis.Redis | aiocluster.RedisCluster:
    """The asyncio flavour of `sync_client` (a cluster client connects on its first command)."""
    if mode == "cluster":
        return aiocluster.RedisCluster.from_url(url, **_cluster_kwargs(op_timeout, retries, True))
    return aioredis.Redis.from_url(url, **client_kwargs(op_timeout, retries, True))


async def wait_until_reachable(url: str, timeout: float, mode: Mode = "standalone") -> None:
    """PING until Redis answers, with backoff; RedisUnavailable after `timeout` seconds. In
    cluster mode the seed node must answer with a slot map and every master must PING back."""
    deadline = time.monotonic() + timeout
    delay, attempt, last_log = 0.05, 0, 0.0
    client = async_client(url, op_timeout=2.0, retries=0, mode=mode)
    try:
        while True:
            attempt += 1
            try:
                if mode == "cluster":
                    await client.ping(target_nodes=aiocluster.RedisCluster.PRIMARIES)
                else:
                    await client.ping()
                if attempt > 1:
                    logger.info("Redis at %s answered after %d attempts", redact_url(url), attempt)
                return
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.RedisClusterException,
                OSError,
            ) as e:
                now = time.monotonic()
                if now >= deadline:
                    raise RedisUnavailable(
                        f"Redis at {redact_url(url)} did not answer within {timeout:.0f}s: {e}"
                    ) from e
                if now - last_log > 5:
                    logger.warning("waiting for Redis at %s: %s", redact_url(url), e)
                    last_log = now
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 1.0)
                if mode == "cluster":  # a client that never got a slot map starts afresh
                    await client.aclose()
                    client = async_client(url, op_timeout=2.0, retries=0, mode=mode)
    finally:
        await client.aclose()


_SUMMED = ("used_memory", "maxmemory", "evicted_keys", "expired_keys")


async def store_stats(client: aioredis.Redis | aiocluster.RedisCluster) -> tuple[dict, dict, int]:
    """(INFO memory, INFO stats, key count) of the whole store: on a cluster, the masters'
    sizes and counters summed (the policy read from one of them)."""
    if not isinstance(client, aiocluster.RedisCluster):
        pipe = client.pipeline(transaction=False)
        pipe.info("memory")
        pipe.info("stats")
        pipe.dbsize()
        memory, stats, keys = await pipe.execute()
        return memory, stats, int(keys)
    masters = aiocluster.RedisCluster.PRIMARIES
    memory_by_node, stats_by_node, keys_by_node = await asyncio.gather(
        client.info("memory", target_nodes=masters),
        client.info("stats", target_nodes=masters),
        client.execute_command("DBSIZE", target_nodes=masters),
    )
    merged = []
    for by_node in (memory_by_node, stats_by_node):
        sections = list(by_node.values())
        total = dict(sections[0]) if sections else {}
        for name in _SUMMED:
            if name in total:
                total[name] = sum(int(s.get(name, 0)) for s in sections)
        merged.append(total)
    keys = keys_by_node if isinstance(keys_by_node, int) else sum(keys_by_node.values())
    return merged[0], merged[1], int(keys)
