"""Where a request's time goes (common/tracing.py): one request through `epd up` is one
OpenTelemetry trace across the proxy, the encoder and the LM worker, exported over OTLP to a
real receiver (epd/bench/otlp.py: a gRPC server implementing the OTLP trace service, run by
the test)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import urllib.request

import grpc
import pytest

from epd.bench.otlp import Span, otlp_receiver
from proto import epd_pb2, epd_pb2_grpc
from tests.cluster_helpers import image_bytes
from tests.test_up import up  # noqa: F401 (the `epd up` fixture)


@pytest.fixture
def otlp():
    with otlp_receiver() as (receiver, endpoint):
        yield receiver, endpoint


def traceparent() -> tuple[str, str, str]:
    """A client's W3C trace context: (header value, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_one_request_is_one_trace_across_proxy_encoder_and_lm_worker(up, otlp):  # noqa: F811
    receiver, endpoint = otlp
    # Spans leave each role a tenth of a second after they end (the SDK reads OTEL_*).
    cluster = up(env={"EPD_TRACING_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    cluster.wait_serving()
    image = image_bytes(84, 56, 7)

    # An image no one has sent: proxy -> encoder -> LM worker, over gRPC.
    header, trace_id, client_span = traceparent()
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(image=image)],
        sampling=epd_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    request.chat.messages.add(
        role="user", content=[epd_pb2.ContentPart(media_index=0), epd_pb2.ContentPart(text="Hi")]
    )
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = epd_pb2_grpc.InferenceStub(channel)
        tokens = [
            t
            for r in stub.Generate(request, timeout=60, metadata=[("traceparent", header)])
            for t in r.token_ids
        ]
    assert len(tokens) == 6

    proxy_stages = {"validate", "cache_check", "encode", "encode_call", "lm_call"}
    encoder_stages = {"preprocess", "queue_wait", "tower", "publish"}
    lm_stages = {"queue_wait", "embedding_wait", "fetch", "prefill_chunk", "decode"}
    roots = {"proxy.request", "encoder.encode", "lm.generate"}
    spans = receiver.wait_for(trace_id, roots | proxy_stages | encoder_stages | lm_stages)
    assert {s.trace_id for s in spans} == {trace_id}
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)

    def one(name: str, service: str) -> Span:
        (span,) = [s for s in spans if s.name == name and s.service == service]
        return span

    def parent(s: Span) -> Span:
        return by_id[s.parent_id]

    root = one("proxy.request", "epd-proxy")
    assert root.parent_id == client_span  # the client's traceparent is the root's parent
    encode, call = one("encode", "epd-proxy"), one("encode_call", "epd-proxy")
    encoder, lm_call = one("encoder.encode", "epd-encoder"), one("lm_call", "epd-proxy")
    lm = one("lm.generate", "epd-lm")
    assert parent(encode) is root and parent(call) is encode and parent(encoder) is call
    assert parent(lm_call) is root and parent(lm) is lm_call
    for name in ("validate", "cache_check"):
        assert parent(one(name, "epd-proxy")) is root
    for name in encoder_stages:
        stage = one(name, "epd-encoder")
        assert parent(stage) is encoder and stage.attributes["mm_hash"], name
    for name in lm_stages - {"prefill_chunk"}:
        assert parent(one(name, "epd-lm")) is lm, name
    chunks = [s for s in spans if s.name == "prefill_chunk"]
    assert chunks and all(parent(c) is lm for c in chunks)
    assert sum(c.attributes["tokens"] for c in chunks) == lm.attributes["prompt_tokens"]
    # What a person looks for: what was held, which worker, how many tokens, the batch.
    assert one("cache_check", "epd-proxy").attributes["held"] == 0
    assert one("tower", "epd-encoder").attributes["batch_items"] == 1
    assert lm_call.attributes["worker"] and lm.attributes["output_tokens"] == 6
    assert one("decode", "epd-lm").attributes["tokens"] == 6
    # Every child lies within its parent's time (one clock: all on this machine; a stage's
    # times are monotonic readings put on the wall clock through an offset each process takes
    # once, so they may sit a few microseconds off a span's own wall-clock reading).
    for s in spans:
        assert s.start <= s.end, s.name
        if s.parent_id in by_id:
            p = by_id[s.parent_id]
            assert p.start <= s.start + 1_000_000 and s.end <= p.end + 5_000_000, (s.name, p.name)

    # The same image again, over HTTP with a traceparent header: held, so no encoder spans.
    header, trace_id, client_span = traceparent()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(image)}},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ],
        "max_tokens": 3,
        "temperature": 0,
    }
    post = urllib.request.Request(
        f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": header},
    )
    with urllib.request.urlopen(post, timeout=60) as reply:
        assert reply.status == 200
    spans = receiver.wait_for(trace_id, {"proxy.request", "lm.generate", "embedding_wait", "fetch"})
    root = next(s for s in spans if s.name == "proxy.request")
    assert root.parent_id == client_span
    assert not [s for s in spans if s.service == "epd-encoder" or s.name.startswith("encode")]
    check = next(s for s in spans if s.name == "cache_check")
    assert check.attributes == {"items": 1, "held": 1}

    # The same stages as one histogram family on the proxy's /metrics.
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics") as reply:
        text = reply.read().decode()
    for stage in ("validate", "cache_check", "encode", "lm_call"):
        assert f'epd_stage_seconds_count{{role="proxy",stage="{stage}"}}' in text, stage


def _data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_tracing_off_loads_no_sdk_and_the_sdk_off_switch_wins():
    """Without an endpoint no role process loads the OpenTelemetry tracing SDK or exporter
    (tracing costs a None a span and a few stage records); OTEL_SDK_DISABLED=true turns it
    off even with one."""
    code = """
import os, sys
from common import tracing
assert tracing.setup("lm", "lm-0", None).enabled is False
import proxy.server, encoder_worker.server, lm_worker.server  # noqa
# (redis-py imports opentelemetry.sdk's package for its own observability hooks: not ours)
ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
loaded = [m for m in sys.modules if m.startswith(ours)]
assert not loaded, loaded
os.environ["OTEL_SDK_DISABLED"] = "true"
assert tracing.setup("lm", "lm-0", "http://127.0.0.1:4317").enabled is False
print("ok")
"""
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.stdout.strip() == "ok", result.stderr
