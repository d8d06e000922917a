"""Where a request's time goes: one OpenTelemetry trace per request across every role it
crosses, and the same stages as one Prometheus histogram family.

    client --traceparent--> proxy: proxy.request
                              validate, cache_check, encode --metadata--> encoder: encoder.encode
                                                                           per item: queue_wait,
                                                                           preprocess, tower,
                                                                           publish
                              lm_call --metadata--> LM worker: lm.generate
                                                      queue_wait, embedding_wait, fetch,
                                                      prefill_chunk (each), decode, kv_*

Tracing is off unless an OTLP endpoint is set (`tracing.otlp_endpoint`, or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SDK_DISABLED=true wins).
Off, `TRACING` is the null tracer: its spans are None, nothing is imported, injected or
exported. The SDK itself reads the other OTEL_* variables (OTEL_SERVICE_NAME,
OTEL_TRACES_SAMPLER, OTEL_BSP_SCHEDULE_DELAY, OTEL_EXPORTER_OTLP_HEADERS...).

Stages are recorded where they happen as `Stage`s (wall-clock nanoseconds: spans from several
processes share one time line) and exported when the role's part of the request ends, as
children of the role's span with their own start and end: the LM engine's thread records two
numbers a stage and never touches the SDK. The same stages feed `epd_stage_seconds{role,
stage}` whether tracing is on or off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

logger = logging.getLogger(__name__)

# Seconds: from a cache check (a millisecond) to a long decode (minutes).
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 300)

# Monotonic seconds (what the engine keeps) to wall-clock nanoseconds (what a span takes).
_WALL_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_seconds: float) -> int:
    return int(monotonic_seconds * 1e9) + _WALL_MINUS_MONOTONIC_NS


def now_ns() -> int:
    return time.time_ns()


@dataclass
class Stage:
    """One stage of one request in one role: [start, end) in wall-clock ns. A stage whose
    callee's spans are its children (an encode, an LM call) has a live `span`, made when it
    began; the others become spans when the role's part ends."""

    name: str
    start: int
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)
    span: Any = None

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 0) / 1e9


class Stages(list):
    """A request's stages in one role, in the order they were recorded."""

    def add(self, name: str, start: int, end: int | None = None, **attributes: Any) -> Stage:
        stage = Stage(name, start, now_ns() if end is None else end, attributes)
        self.append(stage)
        return stage

    def begin(self, name: str, parent: Any, **attributes: Any) -> Stage:
        """A stage whose callee needs its span now (`metadata`), ended by `finish`."""
        stage = Stage(name, now_ns(), 0, attributes)
        stage.span = TRACING.start(name, parent, stage.start, **attributes)
        return stage

    def finish(self, stage: Stage, **attributes: Any) -> None:
        stage.end = now_ns()
        stage.attributes.update(attributes)
        TRACING.end(stage.span, **stage.attributes)  # with those set since it began
        self.append(stage)

    @contextlib.contextmanager
    def time(self, name: str, **attributes: Any) -> Iterator[Stage]:
        """Records the `with` block as a stage (its attributes may be added inside)."""
        stage = Stage(name, now_ns(), 0, attributes)
        try:
            yield stage
        finally:
            stage.end = now_ns()
            self.append(stage)


# One histogram family per registry, whichever roles share it (a process, or a test, may hold
# several roles' metrics in one registry).
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, Histogram] = weakref.WeakKeyDictionary()


class StageMetrics:
    """`epd_stage_seconds{role, stage}`: every role observes its own stages."""

    def __init__(self, role: str, registry: CollectorRegistry | None = REGISTRY):
        self.role = role
        histogram = _FAMILIES.get(registry) if registry is not None else None
        if histogram is None:
            histogram = Histogram(
                "epd_stage_seconds",
                "Time a request spent in each stage, by role (common/tracing.py names them)",
                ["role", "stage"],
                buckets=STAGE_BUCKETS,
                registry=registry,
            )
            if registry is not None:
                _FAMILIES[registry] = histogram
        self.histogram = histogram

    def observe(self, stages: Iterable[Stage]) -> None:
        for s in stages:
            self.histogram.labels(self.role, s.name).observe(s.seconds)


class Tracer:
    """The null tracer (tracing off): what `OtelTracer` does, doing nothing."""

    enabled = False

    def extract(self, carrier: Any) -> Any:
        """The remote parent in gRPC metadata or HTTP headers (`traceparent`), or None."""
        return None

    def start(self, name: str, parent: Any = None, start: int | None = None, **attributes):
        """A live span (ended by `end`), the child of `parent` (a span, a context or None)."""
        return None

    def end(self, span: Any, stages: Sequence[Stage] = (), **attributes: Any) -> None:
        """Ends `span` with `stages` exported as its children."""

    def metadata(self, span: Any) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying `span` as the parent of the callee's spans."""
        return ()

    def shutdown(self) -> None:
        """Exports what is left (a process calls it on its way out)."""


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, service: str, instance: str, endpoint: str | None):
        # Imported here: with tracing off a process never loads the SDK.
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service,
             "service.instance.id": instance}
        )  # fmt: skip
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("epd-cluster")
        self.propagator = TraceContextTextMapPropagator()
        self._trace = trace

    def extract(self, carrier: Any) -> Any:
        if carrier is None:
            return None
        pairs = carrier.items() if hasattr(carrier, "items") else carrier
        headers = {str(k).lower(): v for k, v in pairs}
        if "traceparent" not in headers:
            return None
        return self.propagator.extract(headers)

    def _context(self, parent: Any) -> Any:
        if parent is None or isinstance(parent, dict):  # no parent, or an extracted context
            return parent
        return self._trace.set_span_in_context(parent)

    def start(self, name: str, parent: Any = None, start: int | None = None, **attributes):
        return self.tracer.start_span(
            name, context=self._context(parent), start_time=start, attributes=_clean(attributes)
        )

    def end(self, span: Any, stages: Sequence[Stage] = (), **attributes: Any) -> None:
        if span is None:
            return
        context = self._trace.set_span_in_context(span)
        for s in stages:
            if s.span is not None:  # a live stage: exported when it ended
                continue
            child = self.tracer.start_span(
                s.name, context=context, start_time=s.start, attributes=_clean(s.attributes)
            )
            child.end(end_time=s.end)
        if attributes:
            span.set_attributes(_clean(attributes))
        span.end()

    def metadata(self, span: Any) -> tuple[tuple[str, str], ...]:
        if span is None:
            return ()
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return tuple(carrier.items())

    def shutdown(self) -> None:
        self.provider.shutdown()


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """What a span attribute may hold: str, bool, int, float or a list of one of them."""
    out = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = list(v) if isinstance(v, tuple | list) else v
    return out


TRACING: Tracer = Tracer()  # this process's: `setup` replaces it, `tracer()` returns it


def tracer() -> Tracer:
    return TRACING


def server_span(name: str, context: Any, **attributes: Any) -> Any:
    """A worker's span for a call it serves, the child of the caller's span that the call's
    gRPC metadata carries (None when tracing is off)."""
    if not TRACING.enabled:
        return None
    parent = TRACING.extract(context.invocation_metadata())
    return TRACING.start(name, parent, **attributes)


def otlp_endpoint(configured: str | None) -> str | None:
    """Where spans go: the config's endpoint, else the standard variables'; None: off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return (
        configured
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def setup(role: str, name: str, configured_endpoint: str | None) -> Tracer:
    """This process's tracer (`TRACING`): OTLP export when an endpoint is set, else null."""
    global TRACING
    endpoint = otlp_endpoint(configured_endpoint)
    if endpoint is not None:
        TRACING = OtelTracer(f"epd-{role}", name, endpoint)
        logger.info("tracing: OTLP spans to %s", endpoint)
    return TRACING


def shutdown() -> None:
    TRACING.shutdown()
