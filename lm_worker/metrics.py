"""The LM worker's Prometheus metrics (`epd_lm_*`), registered where it is told.

Roles register them in the process's default registry (what /metrics serves); tests give each
engine a private registry, or none.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from common.tracing import StageMetrics


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.stages = StageMetrics("lm", registry)  # epd_stage_seconds{role="lm"}
        self.ttft = Histogram(
            "epd_lm_time_to_first_token_seconds",
            "LM worker: arrival to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            **kw,
        )
        self.itl = Histogram(
            "epd_lm_inter_token_latency_seconds",
            "LM worker: time between tokens",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
            **kw,
        )
        self.batch_size = Histogram(
            "epd_lm_batch_size",
            "Requests per step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            **kw,
        )
        self.batch_tokens = Histogram(
            "epd_lm_batch_tokens",
            "Tokens per step",
            buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192),
            **kw,
        )
        self.kv_blocks_used = Gauge("epd_lm_kv_blocks_used", "KV cache blocks in use", **kw)
        self.preemptions = Counter("epd_lm_preemptions_total", "Requests preempted", **kw)
        self.requests = Counter(
            "epd_lm_requests_total", "Finished requests by reason", ["finish_reason"], **kw
        )
        self.isolated_failures = Counter(
            "epd_lm_isolated_failures_total",
            "Requests failed alone after their step raised (the rest of the batch went on)",
            **kw,
        )
        self.tokens = Counter("epd_lm_generated_tokens_total", "Tokens generated", **kw)
        self.embedding_misses = Counter(
            "epd_lm_embedding_misses_total",
            "Embeddings a request needed that the cache did not hold",
            **kw,
        )
        self.realtime_sessions = Gauge(
            "epd_lm_realtime_sessions", "Realtime sessions open on this worker", **kw
        )
        self.realtime_rows = Counter(
            "epd_lm_realtime_embeddings_total",
            "Per-position audio embeddings read from realtime session streams",
            **kw,
        )
        self.realtime_waits = Counter(
            "epd_lm_realtime_waiting_steps_total",
            "Engine steps in which a realtime request sat out, waiting for its next audio "
            "embedding",
            **kw,
        )
