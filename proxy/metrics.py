"""The proxy's Prometheus metrics. The names are a contract: operators build dashboards on
them (deploy/ has a Grafana dashboard)."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from common.tracing import StageMetrics

# The raw TTFT / ITL values behind the dashboard's percentiles: the last minute, bounded.
LATENCY_WINDOW_SECONDS = 60.0
LATENCY_SAMPLES = 20_000


class LatencyWindow:
    """The raw values of the last `window` seconds (at most `cap`), and their percentiles."""

    def __init__(self, window: float = LATENCY_WINDOW_SECONDS, cap: int = LATENCY_SAMPLES):
        self.window = window
        self.values: deque[tuple[float, float]] = deque(maxlen=cap)  # (unix time, seconds)

    def add(self, value: float, now: float | None = None) -> None:
        self.values.append((time.time() if now is None else now, value))

    def percentiles(self, now: float | None = None) -> dict[str, Any]:
        horizon = (time.time() if now is None else now) - self.window
        while self.values and self.values[0][0] < horizon:
            self.values.popleft()
        ordered = sorted(v for _, v in self.values)
        n = len(ordered)

        def rank(q: float) -> float | None:  # nearest rank
            return ordered[min(n - 1, math.ceil(q * n) - 1)] if n else None

        return {"count": n, "p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99)}


LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_GAPS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.stages = StageMetrics("proxy", registry)  # epd_stage_seconds{role="proxy"}
        self.requests = Counter(
            "epd_requests_total", "Requests by API and final status", ["api", "status"], **kw
        )
        self.ttft = Histogram(
            "epd_time_to_first_token_seconds", "Proxy arrival to first token", buckets=LATENCY, **kw
        )
        self.itl = Histogram(
            "epd_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=TOKEN_GAPS,
            **kw,
        )
        self.mm_items = Counter(
            "epd_mm_items_total",
            "Media items by what the proxy did: held (cached, no encode), encoded, deduplicated "
            "(joined an encode already in flight)",
            ["result"],
            **kw,
        )
        self.encode_dispatch = Histogram(
            "epd_encode_dispatch_seconds",
            "Encode call to an encoder, sent to answered",
            buckets=LATENCY,
            **kw,
        )
        self.encode_marks = Counter(
            "epd_encode_marks_total",
            "Items this proxy had to encode, by what the shared 'being encoded' mark said: "
            "claimed (encoded here), followed (another proxy was encoding it: waited for it), "
            "taken_over (that proxy's mark lapsed unpublished: encoded here)",
            ["result"],
            **kw,
        )
        self.worker_up = Gauge(
            "epd_worker_up", "1 while the worker reports SERVING", ["role", "worker"], **kw
        )
        self.worker_circuit_open = Gauge(
            "epd_worker_circuit_open",
            "1 while the worker's circuit breaker is open",
            ["role", "worker"],
            **kw,
        )
        self.reencodes = Counter(
            "epd_reencodes_total",
            "Items encoded again because an LM worker found them missing (evicted, flushed)",
            **kw,
        )
        self.pending = Gauge("epd_pending_requests", "Requests in flight in the proxy", **kw)
        self.retries = Counter(
            "epd_retries_total", "Calls retried on another worker", ["role"], **kw
        )
        self.migrations = Counter(
            "epd_migrations_total",
            "Requests moved to another LM worker mid-stream (theirs failed after some output)",
            **kw,
        )
        self.affinity_routes = Counter(
            "epd_prefix_affinity_routes_total",
            "LM calls routed by prefix-cache affinity: to the worker holding the longest prefix "
            "(holder), past it for its load (load), or with no worker holding any (none)",
            ["outcome"],
            **kw,
        )
        self.affinity_blocks = Gauge(
            "epd_prefix_affinity_blocks",
            "Block hashes in the prefix-affinity index (at most proxy.prefix_affinity_blocks; "
            "the proxy's memory grows with it, about 250 bytes a block, until it is full)",
            **kw,
        )
        self.handovers = Counter(
            "epd_pd_handovers_total",
            "Requests handed from a prefill worker to a decode worker (prefill / decode split)",
            **kw,
        )
        self.realtime_sessions = Gauge(
            "epd_realtime_sessions_open", "Realtime audio sessions open", **kw
        )
        self.realtime_sessions_total = Counter(
            "epd_realtime_sessions_total",
            "Realtime sessions ended, by how (commit, cancel, idle, disconnect, error, refused)",
            ["end"],
            **kw,
        )
        self.realtime_audio_seconds = Counter(
            "epd_realtime_audio_seconds_total", "Realtime audio received, in seconds", **kw
        )
        self.realtime_chunk_latency = Histogram(
            "epd_realtime_chunk_latency_seconds",
            "Per realtime audio chunk: received -> the first text delta covering its end sent",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10),
            **kw,
        )
        self.realtime_failovers = Counter(
            "epd_realtime_failovers_total",
            "Realtime sessions moved to another worker mid-session (audio replayed to a new "
            "encoder, or a new LM worker re-prefilled)",
            ["role"],
            **kw,
        )
        # The encoder planner (proxy/planner.py): its answer and its inputs.
        self.encoders_desired = Gauge(
            "epd_encoders_desired",
            "Encoders the current demand needs (the planner's answer: scale the encoders to it)",
            **kw,
        )
        self.planner_need = Gauge(
            "epd_planner_need_encoders",
            "The planner's unrounded need this tick, before its scale-down window and bounds",
            **kw,
        )
        self.planner_work = Gauge(
            "epd_planner_encode_work",
            "Encoder-seconds of encoding per second over the SERVING encoders (sum of their "
            "busy fractions)",
            **kw,
        )
        self.planner_backlog = Gauge(
            "epd_planner_backlog_seconds",
            "Encoder-seconds of work not done at the encoders (queued and running items x "
            "seconds per item)",
            **kw,
        )
        self.planner_seconds_per_item = Gauge(
            "epd_planner_seconds_per_item", "Tower seconds per item, as the encoders report", **kw
        )
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()
        self.chunk_window = LatencyWindow()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.ttft_window.add(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.itl_window.add(seconds)
