"""Connections to the Redis the cluster shares: URL handling and the start-up reachability wait."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)


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


def sync_client(url: str, op_timeout: float = 5.0, retries: int = 3) -> redis.Redis:
    """A blocking client. rediss:// gets TLS (ssl_ca_certs=..., ssl_cert_reqs=... may follow
    in the query string); user:password@ authenticates as an ACL user."""
    return redis.Redis.from_url(url, **client_kwargs(op_timeout, retries, False))


def async_client(url: str, op_timeout: float = 5.0, retries: int = 3) -> aioredis.Redis:
    """The asyncio flavour of `sync_client`."""
    return aioredis.Redis.from_url(url, **client_kwargs(op_timeout, retries, True))


async def wait_until_reachable(url: str, timeout: float) -> None:
    """PING until Redis answers, with backoff; RedisUnavailable after `timeout` seconds."""
    client = async_client(url, op_timeout=2.0, retries=0)
    deadline = time.monotonic() + timeout
    delay, attempt, last_log = 0.05, 0, 0.0
    try:
        while True:
            attempt += 1
            try:
                await client.ping()
                if attempt > 1:
                    logger.info("Redis at %s answered after %d attempts", redact_url(url), attempt)
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
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
    finally:
        await client.aclose()
