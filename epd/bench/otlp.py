"""An OTLP trace receiver on loopback: what a collector would get from the roles, kept in
memory.

    role's OTLPSpanExporter --gRPC ExportTraceServiceRequest--> Receiver.Export -> spans by trace id

`otlp_receiver()` serves one on 127.0.0.1 (a port the OS picks) and hands back the receiver and
the endpoint to give the roles (`tracing.otlp_endpoint`, or EPD_TRACING_OTLP_ENDPOINT).
`epd bench proxy --tracing` counts the spans of its traced requests with it; tests can read whole
traces (service, parent, attributes, times of every span).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str  # the exporting process's service.name (epd-proxy, epd-encoder, epd-lm)
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root without a remote parent
    attributes: dict
    start: int  # wall-clock ns
    end: int


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace service: every span exported to it, by trace id."""

    def __init__(self):
        self.traces: dict[str, list[Span]] = defaultdict(list)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value for a in resource_spans.resource.attributes}
                service = resource["service.name"].string_value
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.traces[s.trace_id.hex()].append(
                            Span(
                                service,
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in s.attributes},
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return list(self.traces.get(trace_id, ()))

    def spans(self, trace_ids: Iterable[str]) -> list[Span]:
        """Every span of these traces received so far."""
        with self.lock:
            return [s for t in trace_ids for s in self.traces.get(t, ())]

    def wait_for(
        self, trace_id: str, names: set[str], timeout: float = 30, settle: float = 0.5
    ) -> list[Span]:
        """The trace once it has a span of every name in `names`, `settle` seconds later (for
        stragglers of the same export). TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                if settle:
                    time.sleep(settle)
                return self.trace(trace_id)
            if time.monotonic() > deadline:
                have = sorted({s.name for s in spans})
                raise TimeoutError(f"trace {trace_id}: waited for {sorted(names)}, have {have}")
            time.sleep(0.1)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    """A Receiver served on loopback while the block runs: (receiver, its OTLP endpoint)."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)
