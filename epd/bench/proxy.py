"""`epd bench proxy`: what the proxy costs, and what the embedding cache saves.

Starts a local cluster (the `epd up` launcher: embedded Redis, one encoder, one LM worker, the
proxy) and measures, side by side in one run:
- added latency: the same one-token request through the proxy (gRPC Inference, chat prompt)
  and straight to the LM worker (LanguageModel.Generate with the proxy's token ids),
  interleaved; the difference of the p50s (target <= 1 ms);
- time to first token for a held image vs a cold one: each request puts unique text before its
  image (so the LM's prefix cache cannot help either side); cold requests bring a new image,
  held ones an image the cache already holds (target held <= 0.5x cold);
- time to first token for a cold image after a longer text, with the LM worker prefilling that
  text while the image encodes (`lm.overlap_encode_prefill`, the default) vs without: a second
  cluster with overlap off runs beside the first, requests alternate between them round by
  round (target <= 0.85x);
- with `--tracing` (measured first), what request tracing costs (common/tracing.py): the same
  cold-image requests, each carrying a client `traceparent`, through the first cluster (tracing
  off: no OTLP endpoint) and a third one exporting to an OTLP receiver the bench serves on
  loopback (epd/bench/otlp.py), alternated round by round: time to first token and total
  latency on vs off, and the spans the receiver got per request on each side (target: off
  none, on vs off about 1.0x).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
from PIL import Image

from common import tracing
from common.cluster_auth import call_token
from common.config import ClusterConfig, load_config
from common.process import free_port
from common.server import GRPC_OPTIONS
from common.tls import cluster_channel
from epd.bench.otlp import Receiver, otlp_receiver
from epd.launcher import LocalCluster
from proto import epd_pb2, epd_pb2_grpc


def _image(size: int, seed: int) -> bytes:
    """A PNG unique to `seed` (below 2**24)."""
    pixels = [
        ((x * 7 + seed * 31) % 256, (y * 3 + seed * 11) % 256, (x * y + seed) % 256)
        for y in range(size)
        for x in range(size)
    ]
    # The pattern repeats every 256 seeds (a cold image would be another's held one): the
    # first pixel carries the seed.
    pixels[0] = (seed & 255, (seed >> 8) & 255, (seed >> 16) & 255)
    image = Image.new("RGB", (size, size))
    image.putdata(pixels)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _chat(texts_and_images: list, max_tokens: int) -> epd_pb2.GenerateRequest:
    request = epd_pb2.GenerateRequest(
        sampling=epd_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    parts = []
    for piece in texts_and_images:
        if isinstance(piece, bytes):
            request.media.add(image=piece)
            parts.append(epd_pb2.ContentPart(media_index=len(request.media) - 1))
        else:
            parts.append(epd_pb2.ContentPart(text=piece))
    request.chat.messages.add(role="user", content=parts)
    return request


def _ttft(stub, request) -> tuple[float, epd_pb2.GenerateResponse]:
    first, _, last = _timed(stub, request)
    return first, last


def _timed(stub, request, metadata=()) -> tuple[float, float, epd_pb2.GenerateResponse]:
    """(time to first token, total seconds, the last response)."""
    started = time.perf_counter()
    first, last = None, None
    for response in stub.Generate(request, timeout=300, metadata=metadata):
        if first is None and response.token_ids:
            first = time.perf_counter() - started
        last = response
    return first, time.perf_counter() - started, last


def run(args: argparse.Namespace) -> int:
    overrides = {
        "model.path": args.model,
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    config = load_config(None, given)
    if args.tracing:
        _check_tracing(config)
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(_started(config))
        # The side without overlap: the same cluster on its own ports and Redis.
        baseline = stack.enter_context(
            _started(_beside(given, {"lm.overlap_encode_prefill": False}))
        )
        proxy = epd_pb2_grpc.InferenceStub(stack.enter_context(_channel(cluster)))
        serial = epd_pb2_grpc.InferenceStub(stack.enter_context(_channel(baseline)))
        lm = epd_pb2_grpc.LanguageModelStub(stack.enter_context(_lm_channel(cluster)))
        if args.tracing:
            # Left in reverse: the traced cluster stops (its roles export what is left) before
            # the receiver does.
            receiver, endpoint = stack.enter_context(otlp_receiver())
            traced = stack.enter_context(
                _started(_beside(given, {"tracing.otlp_endpoint": endpoint}))
            )
            traced_proxy = epd_pb2_grpc.InferenceStub(stack.enter_context(_channel(traced)))
        # First: the two sides have then served the same requests (their warm-ups), no more.
        traced_figures = _tracing_cost(proxy, traced_proxy, receiver, args) if args.tracing else {}
        summary = _measure(proxy, lm, args)
        summary.update(_overlap(proxy, serial, args))
        summary.update(traced_figures)
    print(json.dumps(summary))
    return 0


def _beside(given: dict[str, Any], settings: dict[str, Any]) -> ClusterConfig:
    """The bench's cluster on its own ports (and its own Redis), with `settings` changed."""
    return load_config(
        None,
        {**given, "proxy.grpc_port": free_port(), "proxy.http_port": free_port(), **settings},
    )


@contextlib.contextmanager
def _started(config: ClusterConfig) -> Iterator[LocalCluster]:
    """A local cluster (one encoder, one LM worker, the proxy) while the block runs."""
    cluster = LocalCluster(config, num_encoders=1, num_lm_workers=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _channel(cluster: LocalCluster) -> grpc.Channel:
    return grpc.insecure_channel(cluster.proxy.address, options=GRPC_OPTIONS)


def _lm_channel(cluster: LocalCluster) -> grpc.Channel:
    """A channel straight to the first LM worker, carrying the cluster token as the proxy does."""
    c = cluster.config.cluster
    return cluster_channel(cluster.lm_workers[0].address, c.tls, token=call_token(c))


_VOCABULARY = (
    "the quick survey of harbour records lists ships cargo weather crews tides and notes "
    "from each morning watch about lamps ropes sails bread water salt wind and rain"
)
_WORDS = _VOCABULARY.split()


def _long_text(n: int, seed: int) -> str:
    """`n` words, unique to `seed` from the first word on (no shared prefix to cache)."""
    words = [_WORDS[(seed * 7 + k * (seed % 5 + 1)) % len(_WORDS)] for k in range(n)]
    return f"Record {seed}: " + " ".join(words)


def _overlap(overlapped, serial, args) -> dict:
    """Cold-image TTFT after `args.prefix_words` words of text: overlap on vs off."""
    sides = {"overlap": overlapped, "serial": serial}
    for stub in sides.values():  # warm both paths (tower, prefill shapes)
        _ttft(stub, _chat([_long_text(args.prefix_words, 99_999), _image(64, 99_999), "?"], 1))
    ttfts: dict[str, list[float]] = {"overlap": [], "serial": []}
    prompt_tokens = 0
    for i in range(args.image_requests):
        order = ["overlap", "serial"] if i % 2 == 0 else ["serial", "overlap"]
        for side in order:
            seed = 20_000 + 2 * i + (side == "serial")
            request = _chat([_long_text(args.prefix_words, seed), _image(args.image_size, seed)], 1)
            t, last = _ttft(sides[side], request)
            assert last.usage.mm_items_encoded == 1, "a cold image must be encoded"
            prompt_tokens = last.usage.prompt_tokens
            ttfts[side].append(t)
    p50 = {side: statistics.median(v) for side, v in ttfts.items()}
    ratio = p50["overlap"] / p50["serial"]
    print(
        f"time to first token, cold {args.image_size}x{args.image_size} image after "
        f"{args.prefix_words} words ({prompt_tokens} prompt tokens): overlap p50 "
        f"{p50['overlap'] * 1e3:.1f} ms, without {p50['serial'] * 1e3:.1f} ms ({ratio:.2f}x)",
        flush=True,
    )
    return {
        "overlap_prompt_tokens": prompt_tokens,
        "cold_ttft_overlap_p50_ms": round(p50["overlap"] * 1e3, 2),
        "cold_ttft_serial_p50_ms": round(p50["serial"] * 1e3, 2),
        "overlap_vs_serial_ttft": round(ratio, 3),
    }


# Each role's span of a request: a trace that has all three has had all its spans exported (a
# role ends its own span last, and its exporter sends spans in the order they ended).
TRACE_ROOTS = {"proxy.request", "encoder.encode", "lm.generate"}


def _check_tracing(off: ClusterConfig) -> None:
    """The comparison needs tracing off on one side and on on the other."""
    if tracing.otlp_endpoint(off.tracing.otlp_endpoint) is not None:
        raise SystemExit(
            "--tracing compares against tracing off, and this environment turns it on "
            "(EPD_TRACING_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT): unset it"
        )
    if tracing.otlp_endpoint(configured="http://127.0.0.1:4317") is None:  # as the receiver
        raise SystemExit("--tracing: OTEL_SDK_DISABLED=true turns tracing off on both sides")


def _tracing_cost(off, on, receiver: Receiver, args) -> dict:
    """The same cold-image requests, each with its own client trace context, through a cluster
    with tracing off and one exporting to `receiver`, sides alternated round by round: TTFT and
    total latency on vs off, and the spans each side's requests left at the receiver."""
    sides = {"off": off, "on": on}
    for stub in sides.values():  # warm both paths (tower, prefill shapes, the first export)
        _timed(stub, _chat(["warm-up", _image(64, 99_998), "?"], args.tracing_tokens))
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    total: dict[str, list[float]] = {"off": [], "on": []}
    traces: dict[str, list[str]] = {"off": [], "on": []}
    n = args.image_requests
    for i in range(n):
        # The same request on both sides: each cluster has its own cache, so both encode it.
        request = _chat(
            [f"Trace {i}:", _image(args.image_size, 30_000 + i), "Describe."], args.tracing_tokens
        )
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            trace_id = secrets.token_hex(16)
            header = ("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")
            first, seconds, last = _timed(sides[side], request, (header,))
            assert last.usage.mm_items_encoded == 1, "a cold image must be encoded"
            ttft[side].append(first)
            total[side].append(seconds)
            traces[side].append(trace_id)
    # The roles export in batches (OTEL_BSP_SCHEDULE_DELAY: every 5 s unless set).
    for trace_id in traces["on"]:
        receiver.wait_for(trace_id, TRACE_ROOTS, timeout=60, settle=0)
    spans = {side: receiver.spans(ids) for side, ids in traces.items()}
    by_service = Counter(s.service for s in spans["on"])
    per_service = {k: round(v / n, 2) for k, v in sorted(by_service.items())}
    p50 = {
        (kind, side): statistics.median(values[side])
        for kind, values in (("ttft", ttft), ("total", total))
        for side in sides
    }
    ratio = {kind: p50[kind, "on"] / p50[kind, "off"] for kind in ("ttft", "total")}
    services = ", ".join(f"{k} {v:g}" for k, v in per_service.items())
    print(
        f"tracing on vs off, cold {args.image_size}x{args.image_size} image, "
        f"{args.tracing_tokens} tokens, {n} requests a side alternated: TTFT p50 on "
        f"{p50['ttft', 'on'] * 1e3:.1f} ms, off {p50['ttft', 'off'] * 1e3:.1f} ms "
        f"({ratio['ttft']:.3f}x); total p50 on {p50['total', 'on'] * 1e3:.1f} ms, off "
        f"{p50['total', 'off'] * 1e3:.1f} ms ({ratio['total']:.3f}x); spans received per "
        f"request: on {len(spans['on']) / n:g} ({services}), off {len(spans['off']) / n:g}",
        flush=True,
    )
    return {
        "tracing_requests": n,
        "tracing_tokens": args.tracing_tokens,
        "tracing_ttft_on_p50_ms": round(p50["ttft", "on"] * 1e3, 2),
        "tracing_ttft_off_p50_ms": round(p50["ttft", "off"] * 1e3, 2),
        "tracing_on_vs_off_ttft": round(ratio["ttft"], 3),
        "tracing_total_on_p50_ms": round(p50["total", "on"] * 1e3, 2),
        "tracing_total_off_p50_ms": round(p50["total", "off"] * 1e3, 2),
        "tracing_on_vs_off_total": round(ratio["total"], 3),
        "tracing_spans_per_request_on": round(len(spans["on"]) / n, 2),
        "tracing_spans_per_request_off": round(len(spans["off"]) / n, 2),
        "tracing_spans_per_request_by_service": per_service,
    }


def _measure(proxy, lm, args) -> dict:
    # Added latency: one token, a text prompt, through the proxy vs straight to the LM.
    text = _chat(["Say one word."], max_tokens=1)
    text.return_prompt_token_ids = True
    first = list(proxy.Generate(text, timeout=300))
    direct = epd_pb2.LMGenerateRequest(
        prompt_token_ids=first[0].prompt_token_ids, sampling=text.sampling
    )
    via_proxy, via_lm = [], []
    for _ in range(args.requests):
        started = time.perf_counter()
        list(proxy.Generate(text, timeout=300))
        via_proxy.append(time.perf_counter() - started)
        started = time.perf_counter()
        list(lm.Generate(direct, timeout=300))
        via_lm.append(time.perf_counter() - started)
    p50_proxy, p50_lm = statistics.median(via_proxy), statistics.median(via_lm)
    # Paired: each proxy call minus the direct call right after it, so drift cancels.
    added = statistics.median(p - d for p, d in zip(via_proxy, via_lm, strict=True))
    print(
        f"one-token request: proxy p50 {p50_proxy * 1e3:.2f} ms, LM worker direct p50 "
        f"{p50_lm * 1e3:.2f} ms: the proxy adds {added * 1e3:.2f} ms (median of pairs)",
        flush=True,
    )

    # TTFT for a held image vs a cold one, unique text before each image.
    held_image = _image(args.image_size, seed=10_000)
    _ttft(proxy, _chat(["warm-up", held_image, "Describe it."], 1))
    cold, held = [], []
    for i in range(args.image_requests):
        t, last = _ttft(proxy, _chat([f"Cold {i}:", _image(args.image_size, i), "Describe."], 1))
        assert last.usage.mm_items_encoded == 1, "a cold image must be encoded"
        cold.append(t)
        t, last = _ttft(proxy, _chat([f"Held {i}:", held_image, "Describe."], 1))
        assert last.usage.mm_items_held == 1, "the held image must come from the cache"
        held.append(t)
    p50_cold, p50_held = statistics.median(cold), statistics.median(held)
    print(
        f"time to first token, {args.image_size}x{args.image_size} image: cold p50 "
        f"{p50_cold * 1e3:.1f} ms, held p50 {p50_held * 1e3:.1f} ms "
        f"({p50_held / p50_cold:.2f}x)",
        flush=True,
    )
    return {
        "bench": "proxy",
        "requests": args.requests,
        "proxy_p50_ms": round(p50_proxy * 1e3, 3),
        "lm_direct_p50_ms": round(p50_lm * 1e3, 3),
        "proxy_added_p50_ms": round(added * 1e3, 3),
        "image_size": args.image_size,
        "cold_ttft_p50_ms": round(p50_cold * 1e3, 2),
        "held_ttft_p50_ms": round(p50_held * 1e3, 2),
        "held_vs_cold_ttft": round(p50_held / p50_cold, 3),
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="proxy overhead vs the LM worker direct; held vs cold TTFT; overlap on vs off; "
        "tracing on vs off (--tracing)",
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in small model)")
    p.add_argument("--requests", type=int, default=50, help="one-token requests per side")
    p.add_argument("--image-requests", type=int, default=8, help="image requests per side")
    p.add_argument("--image-size", type=int, default=448, help="square image side in pixels")
    p.add_argument(
        "--prefix-words",
        type=int,
        default=200,
        help="words of text before the image in the overlap comparison",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also compare tracing on (OTLP to a receiver on loopback) vs off: a third cluster, "
        "--image-requests cold-image requests a side",
    )
    p.add_argument(
        "--tracing-tokens", type=int, default=16, help="output tokens a request with --tracing"
    )
    p.add_argument("--grpc-port", type=int, help="proxy gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, help="proxy HTTP port (default 8000)")
    p.set_defaults(func=run)
