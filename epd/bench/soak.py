"""`epd bench soak`: a mixed load for N minutes against a local cluster (the `epd up` launcher),
with the latency and every role's RSS per interval (a minute by default).

The load: `--concurrency` clients in a loop, each request streamed over gRPC and drawn in turn
from text-only prompts, images the cache already holds, and new images. What a soak shows is
drift: the last interval is compared with the first (latency ratio, RSS growth per role), side
by side in one run, and with the first interval after `--warmup-minutes` (an LM worker's RSS
grows while its KV cache is first touched, block by block, up to `lm.kv_cache_bytes`; flat
after that is what a long soak must show). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from PIL import Image

from common.config import load_config
from common.server import GRPC_OPTIONS
from epd.launcher import LocalCluster
from proto import epd_pb2, epd_pb2_grpc


def _image(size: int, seed: int) -> bytes:
    image = Image.new("RGB", (size, size), ((seed * 37) % 256, (seed * 91) % 256, seed % 256))
    for x in range(0, size, 4):  # a few distinct pixels, so patches differ
        image.putpixel((x, (x * 7 + seed) % size), (x % 256, 255 - x % 256, (seed * 13) % 256))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _request(kind: str, i: int, args) -> epd_pb2.GenerateRequest:
    request = epd_pb2.GenerateRequest(
        sampling=epd_pb2.SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        )
    )
    parts = []
    if kind != "text":
        seed = 0 if kind == "held" else 1000 + i
        request.media.add(image=_image(args.image_size, seed))
        parts.append(epd_pb2.ContentPart(media_index=0))
    parts.append(epd_pb2.ContentPart(text=f"Request {i}: say something."))
    request.chat.messages.add(role="user", content=parts)
    return request


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _affinity_blocks(config) -> int | None:
    """The proxy's prefix-affinity index size (its `/metrics`): the proxy's RSS grows with it
    until it holds `proxy.prefix_affinity_blocks`."""
    url = f"http://127.0.0.1:{config.proxy.http_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("epd_prefix_affinity_blocks "):
            return int(float(line.split()[1]))
    return None


class _Window:
    def __init__(self):
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()


def run(args: argparse.Namespace) -> int:
    overrides = {
        "model.path": args.model,
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
    }
    config = load_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    cluster = LocalCluster(config, num_encoders=args.encoders, num_lm_workers=args.lm_workers)
    cluster.start()
    try:
        summary = _soak(cluster, args)
    finally:
        cluster.stop()
    print(json.dumps(summary))
    return 0


def _soak(cluster: LocalCluster, args) -> dict:
    pids = {r.name: r.child.pid for r in cluster.roles}
    if cluster.redis is not None:
        pids["redis"] = cluster.redis.child.pid
    duration = args.minutes * 60
    windows: list[_Window] = [_Window()]
    counter = iter(range(10**12))
    kinds = ("text", "held", "new")
    stop = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(cluster.proxy.address, options=GRPC_OPTIONS) as channel:
            stub = epd_pb2_grpc.InferenceStub(channel)
            while not stop.is_set():
                i = next(counter)
                request = _request(kinds[i % 3], i, args)
                started = time.perf_counter()
                try:
                    list(stub.Generate(request, timeout=120))
                    error = None
                except grpc.RpcError as e:
                    error = f"{e.code().name}: {e.details()}"
                window = windows[-1]
                with window.lock:
                    if error is None:
                        window.latencies.append(time.perf_counter() - started)
                    else:
                        window.errors.append(error)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    started = time.monotonic()
    per_interval = []
    while True:
        remaining = duration - (time.monotonic() - started)
        time.sleep(max(min(args.interval_seconds, remaining), 0))
        window = windows[-1]
        last = time.monotonic() - started >= duration - 1e-3
        if not last:
            windows.append(_Window())
        with window.lock:
            lat = sorted(window.latencies)
            row = {
                "interval": len(per_interval) + 1,
                "requests": len(lat) + len(window.errors),
                "errors": len(window.errors),
                "p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
                "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 1)
                if lat
                else None,
                "rss_mib": {name: _rss_mib(pid) for name, pid in pids.items()},
                "proxy_affinity_blocks": _affinity_blocks(cluster.config),
                "first_error": window.errors[0] if window.errors else None,
            }
        per_interval.append(row)
        rss = ", ".join(f"{k} {v:.0f}" for k, v in row["rss_mib"].items() if v is not None)
        print(
            f"interval {row['interval']}: {row['requests']} requests, {row['errors']} errors, "
            f"p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms; RSS MiB: {rss}; "
            f"proxy prefix-affinity blocks {row['proxy_affinity_blocks']}",
            flush=True,
        )
        if last:
            break
    stop.set()
    for t in threads:
        t.join(150)
    first, final = per_interval[0], per_interval[-1]
    # The first interval that starts once warm-up is over (the last one if none does).
    warm = min(int(args.warmup_minutes * 60 // args.interval_seconds), len(per_interval) - 1)
    return {
        "bench": "soak",
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(r["requests"] for r in per_interval),
        "errors": sum(r["errors"] for r in per_interval),
        "last_vs_first_p50": _p50_ratio(first, final),
        "rss_growth_mib": _growth(first, final),
        "warmup_minutes": args.warmup_minutes,
        "after_warmup": {
            "from_interval": per_interval[warm]["interval"],
            "last_vs_first_p50": _p50_ratio(per_interval[warm], final),
            "rss_growth_mib": _growth(per_interval[warm], final),
        },
        "intervals": per_interval,
    }


def _p50_ratio(first: dict, final: dict) -> float | None:
    if not (first["p50_ms"] and final["p50_ms"]):
        return None
    return round(final["p50_ms"] / first["p50_ms"], 3)


def _growth(first: dict, final: dict) -> dict[str, float]:
    """RSS MiB gained per role from one interval's end to another's."""
    before, after = first["rss_mib"], final["rss_mib"]
    return {
        name: round(after[name] - before[name], 1)
        for name in after
        if before.get(name) is not None and after[name] is not None
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="mixed load for N minutes: latency and RSS per role")
    p.add_argument("--config", help="cluster YAML file (defaults fill in the rest)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    p.add_argument("--interval-seconds", type=float, default=60.0, help="one row per interval")
    p.add_argument(
        "--warmup-minutes",
        type=float,
        default=5.0,
        help="drift is also given from the first interval after this (default 5)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="clients in a loop")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    p.add_argument("--image-size", type=int, default=224, help="square image side in pixels")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--lm-workers", type=int, default=1)
    p.add_argument("--grpc-port", type=int, help="proxy gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, help="proxy HTTP port (default 8000)")
    p.set_defaults(func=run)
