"""The connector's Prometheus metrics, one set per connector, registered where it is told.

Roles register them in the process's default registry (what /metrics serves); tests give each
connector a private registry and read values with `registry.get_sample_value(...)`.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Seconds: a 16 MiB entry takes about 15 ms on loopback; a remote Redis adds its round trip.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


_OPS = ("get", "has")
_TIERS = ("local", "redis")


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.lookups = Counter(
            "epd_ec_lookups_total",
            "Embedding lookups by operation (has, get), tier (local, redis) and result (hit, miss)",
            ["op", "tier", "result"],
            **kw,
        )
        self.puts = Counter(
            "epd_ec_puts_total", "Puts by result (stored, held, failed)", ["result"], **kw
        )
        self.bytes = Counter(
            "epd_ec_bytes_total",
            "Entry bytes moved to Redis (out) and from Redis (in)",
            ["direction"],
            **kw,
        )
        self.put_seconds = Histogram(
            "epd_ec_put_seconds", "Put latency (one entry)", buckets=LATENCY_BUCKETS, **kw
        )
        self.get_seconds = Histogram(
            "epd_ec_get_seconds", "get_many latency (one call)", buckets=LATENCY_BUCKETS, **kw
        )
        self.corrupt = Counter(
            "epd_ec_corrupt_entries_total",
            "Entries that failed to decode (deleted, treated as misses)",
            **kw,
        )
        self.redis_errors = Counter(
            "epd_ec_redis_errors_total", "Redis errors by kind", ["kind"], **kw
        )
        self.local_bytes = Gauge(
            "epd_ec_local_tier_bytes", "Bytes held in the local hot tier", **kw
        )
        self.notifications = Counter(
            "epd_ec_notifications_total", "Publish notifications received by waiters", **kw
        )
        # Resolved once: labels() costs microseconds on every call of the hot path.
        self.hit = {
            (op, tier): self.lookups.labels(op, tier, "hit") for op in _OPS for tier in _TIERS
        }
        self.miss = {
            (op, tier): self.lookups.labels(op, tier, "miss") for op in _OPS for tier in _TIERS
        }
        self.bytes_in = self.bytes.labels("in")
        self.bytes_out = self.bytes.labels("out")
