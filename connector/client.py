"""Connections to the Redis the cluster shares: URL handling and the start-up reachability wait."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

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


def async_client(url: str, **kwargs) -> aioredis.Redis:
    """An asyncio client; rediss:// URLs get TLS, user:password@ becomes AUTH (ACL user)."""
    kwargs.setdefault("socket_connect_timeout", 2.0)
    return aioredis.Redis.from_url(url, **kwargs)


async def wait_until_reachable(url: str, timeout: float) -> None:
    """PING until Redis answers, with backoff; RedisUnavailable after `timeout` seconds."""
    client = async_client(url)
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
