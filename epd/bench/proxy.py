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
  round (target <= 0.85x).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import grpc
from PIL import Image

from common.cluster_auth import call_token
from common.config import load_config
from common.process import free_port
from common.server import GRPC_OPTIONS
from common.tls import cluster_channel
from epd.launcher import LocalCluster
from proto import epd_pb2, epd_pb2_grpc


def _image(size: int, seed: int) -> bytes:
    image = Image.new("RGB", (size, size))
    image.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 3 + seed * 11) % 256, (x * y + seed) % 256)
            for y in range(size)
            for x in range(size)
        ]
    )
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
    started = time.perf_counter()
    first, last = None, None
    for response in stub.Generate(request, timeout=300):
        if first is None and response.token_ids:
            first = time.perf_counter() - started
        last = response
    return first, last


def run(args: argparse.Namespace) -> int:
    overrides = {
        "model.path": args.model,
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
    }
    config = load_config(None, {k: v for k, v in overrides.items() if v is not None})
    # The side without overlap: the same cluster on its own ports and Redis.
    serial = load_config(
        None,
        {
            **{k: v for k, v in overrides.items() if v is not None},
            "proxy.grpc_port": free_port(),
            "proxy.http_port": free_port(),
            "lm.overlap_encode_prefill": False,
        },
    )
    cluster = LocalCluster(config, num_encoders=1, num_lm_workers=1)
    baseline = LocalCluster(serial, num_encoders=1, num_lm_workers=1)
    try:
        cluster.start()
        baseline.start()
        with (
            grpc.insecure_channel(cluster.proxy.address, options=GRPC_OPTIONS) as proxy_channel,
            grpc.insecure_channel(baseline.proxy.address, options=GRPC_OPTIONS) as serial_channel,
            _lm_channel(cluster) as lm_channel,
        ):
            proxy = epd_pb2_grpc.InferenceStub(proxy_channel)
            lm = epd_pb2_grpc.LanguageModelStub(lm_channel)
            summary = _measure(proxy, lm, args)
            summary.update(_overlap(proxy, epd_pb2_grpc.InferenceStub(serial_channel), args))
    finally:
        baseline.stop()
        cluster.stop()
    print(json.dumps(summary))
    return 0


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
        help="proxy overhead vs the LM worker direct; held vs cold TTFT; overlap on vs off",
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
    p.add_argument("--grpc-port", type=int, help="proxy gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, help="proxy HTTP port (default 8000)")
    p.set_defaults(func=run)
