"""The EC (embedding cache) connector: Redis-backed store of encoder outputs keyed by mm_hash."""

from connector.client import RedisUnavailable, redact_url, wait_until_reachable
from connector.ec import ConnectorError, ECConnector, PutResult
from connector.ec_async import AsyncECConnector
from connector.embedded import EmbeddedRedis, EmbeddedServerError
from connector.health import StoreUnavailable

__all__ = [
    "AsyncECConnector",
    "ConnectorError",
    "ECConnector",
    "EmbeddedRedis",
    "EmbeddedServerError",
    "PutResult",
    "RedisUnavailable",
    "StoreUnavailable",
    "redact_url",
    "wait_until_reachable",
]
