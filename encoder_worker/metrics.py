"""The encoder worker's Prometheus metrics (`epd_encoder_*`), registered where it is told.

The role registers them in the process's default registry (served on `encoder.metrics_port`);
tests pass a private `CollectorRegistry`, benchmarks None.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from common.tracing import StageMetrics

# Why an item failed; the servicer maps each to a gRPC status code.
ERROR_KINDS = ("invalid_argument", "permission_denied", "unavailable", "internal")

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.stages = StageMetrics("encoder", registry)  # epd_stage_seconds{role="encoder"}
        self.encode_seconds = Histogram(
            "epd_encoder_encode_seconds",
            "Per item: accepted to published (preprocess, queue, tower, put)",
            buckets=_SECONDS,
            **kw,
        )
        self.preprocess_seconds = Histogram(
            "epd_encoder_preprocess_seconds",
            "Per item: decoding and preprocessing",
            buckets=_SECONDS,
            **kw,
        )
        self.tower_seconds = Histogram(
            "epd_encoder_tower_seconds", "Per batch: one tower forward", buckets=_SECONDS, **kw
        )
        self.batch_items = Histogram(
            "epd_encoder_batch_items",
            "Items per tower forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            **kw,
        )
        self.batch_tokens = Histogram(
            "epd_encoder_batch_tokens",
            "Embeddings (placeholder tokens) per tower forward",
            buckets=(64, 256, 1024, 4096, 8192, 16384, 65536),
            **kw,
        )
        self.items_encoded = Counter(
            "epd_encoder_items_encoded_total", "Items the tower ran on", **kw
        )
        self.items_held = Counter(
            "epd_encoder_items_held_total",
            "Items reported HELD: the cache already held them (no tower work), or another "
            "encoder published them first",
            **kw,
        )
        self.items_deduplicated = Counter(
            "epd_encoder_items_deduplicated_total",
            "Items that joined an encode of the same mm_hash already in flight here",
            **kw,
        )
        self.bytes_published = Counter(
            "epd_encoder_bytes_published_total", "Entry bytes this worker stored in the cache", **kw
        )
        self.errors = Counter(
            "epd_encoder_errors_total",
            "Items that failed, by kind (invalid_argument, unavailable, internal)",
            ["kind"],
            **kw,
        )
        self.streams_open = Gauge(
            "epd_encoder_streams_open", "Realtime sessions (EncodeStream calls) open", **kw
        )
        self.stream_chunk_seconds = Histogram(
            "epd_encoder_stream_chunk_seconds",
            "Per realtime audio chunk: the streaming encoder's time on it",
            buckets=(0.001, 0.0025, *_SECONDS),
            **kw,
        )
        self.stream_audio_seconds = Counter(
            "epd_encoder_stream_audio_seconds_total", "Realtime audio taken, in seconds", **kw
        )
        self.stream_embeddings = Counter(
            "epd_encoder_stream_embeddings_total",
            "Per-position embeddings published to realtime session streams",
            **kw,
        )
        # Resolved once: labels() costs microseconds on every call.
        self.error = {kind: self.errors.labels(kind) for kind in ERROR_KINDS}
