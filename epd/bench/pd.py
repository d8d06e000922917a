"""`epd bench pd`: the prefill / decode split against LM workers that do both, on the same
cores and model.

The workload: `--streams` clients decode short text prompts back to back (steady decodes),
while `--long-requests` long image prompts arrive every `--interval` seconds. Each topology is
an `epd up` cluster (embedded Redis, one encoder, the proxy):

    both   two LM workers doing prefill and decode (lm.role both)
    pd     one prefill worker and one decode worker (the KV tier: `--kv-connector`)

    pd-steps   pd on the direct path with lm.kv_send_layerwise off: each step's blocks go
               after its forward, not layer by layer during it (`--kv-connector direct`)

Every topology's cluster is up for the whole run; `--rounds` runs the load on each in turn,
the order reversed every other round (fresh prompts and images each round), and pools the
samples: neither side is always the first after start-up.

Per topology: the short streams' inter-token latency and time to first token, the long
prompts' time to first token, at p50 / p99; for pd, the KV bytes moved and the rate of the
cluster's own transfers (bytes sent / seconds spent sending). Beside them, the raw rates of the
paths a block can take, measured here on values of the model's block size: Redis SET and GET
(the shared tier), the direct path's socket (length-prefixed frames, acknowledged batches) and
a gRPC client stream of the same bytes.

The handover probe (`--handover-rounds`, on the direct path) isolates what sending layer by
layer buys: in one process, a prefill engine hands long text prompts over to a KV receiver on
loopback, with lm.kv_send_layerwise on and off (two engines, the same model and cores),
alternating request by request. Per side: the handover time (request in -> its first token
sampled and every block of it acknowledged by the receiver: what a prefill worker waits for
before the first token goes to the client), the part of it after the forward (the transfer not
hidden behind compute) and the transfer rate. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import torch
from PIL import Image

from common.cluster_auth import call_token
from common.config import LMConfig, load_config
from common.process import free_port
from common.served_model import ensure_bench_model
from common.server import GRPC_OPTIONS
from common.tls import cluster_channel
from connector.embedded import EmbeddedRedis
from connector.kv import KVStore, encode_block, peek_key
from connector.kv_stream import KVInbox, KVReceiver, KVSender
from epd.launcher import LocalCluster
from lm_worker.attention import PagedAttention
from lm_worker.loader import build_engine
from lm_worker.request import Request
from lm_worker.server import kv_counters
from models import SamplingParams, load_family
from proto import epd_pb2, epd_pb2_grpc

TOPOLOGIES = ("both", "pd", "pd-steps")


def _png(size: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _request(text: str, max_tokens: int, image: bytes | None = None) -> epd_pb2.GenerateRequest:
    msg = epd_pb2.GenerateRequest(
        sampling=epd_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    parts = []
    if image is not None:
        msg.media.add(image=image)
        parts.append(epd_pb2.ContentPart(media_index=0))
    parts.append(epd_pb2.ContentPart(text=text))
    msg.chat.messages.add(role="user", content=parts)
    return msg


async def _one(stub, msg) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one streamed request."""
    started = time.perf_counter()
    first, last, gaps = None, None, []
    async for response in stub.Generate(msg, timeout=600):
        if not response.token_ids:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
    return (first or time.perf_counter()) - started, gaps


async def _workload(address: str, args, round_: int = 0) -> dict:
    """One run of the mixed load; its raw samples (seconds). Prompts and images are new in
    each round (no prefix or embedding cache hit carries over)."""
    channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    stub = epd_pb2_grpc.InferenceStub(channel)
    await _one(stub, _request("warm up", 2, _png(64, 1 << 20)))  # start-up costs out of the figures
    short_ttft, short_itl, long_ttft = [], [], []
    done = asyncio.Event()

    async def stream(i: int) -> None:
        n = 0
        while not done.is_set():
            ttft, gaps = await _one(
                stub, _request(f"Round {round_} stream {i} turn {n}: go on", args.short_tokens)
            )
            short_ttft.append(ttft)
            short_itl.extend(gaps)
            n += 1

    async def longs() -> None:
        pending = []
        for j in range(args.long_requests):
            image = _png(args.image_size, round_ * 1000 + j)
            text = f"Round {round_} long prompt {j}: describe every detail"
            pending.append(
                asyncio.ensure_future(_one(stub, _request(text, args.long_tokens, image)))
            )
            await asyncio.sleep(args.interval)
        for ttft, _ in await asyncio.gather(*pending):
            long_ttft.append(ttft)
        done.set()

    started = time.perf_counter()
    await asyncio.gather(longs(), *(stream(i) for i in range(args.streams)))
    wall = time.perf_counter() - started
    await channel.close()
    return {
        "wall_s": wall,
        "short_ttft": short_ttft,
        "short_itl": short_itl,
        "long_ttft": long_ttft,
    }


def _summarize(samples: dict) -> dict:
    return {
        "wall_s": round(samples["wall_s"], 2),
        "short_requests": len(samples["short_ttft"]),
        "short_itl_ms": _pct(samples["short_itl"]),
        "short_ttft_ms": _pct(samples["short_ttft"]),
        "long_ttft_ms": _pct(samples["long_ttft"]),
    }


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {
        "p50": round(float(np.percentile(a, 50)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
    }


def _lm_loads(cluster: LocalCluster) -> list[epd_pb2.LMLoad]:
    loads = []
    c = cluster.config.cluster  # the proxy's cluster token: workers answer only it
    for role in cluster.lm_workers:
        with cluster_channel(role.address, c.tls, token=call_token(c)) as channel:
            stub = epd_pb2_grpc.LanguageModelStub(channel)
            loads.append(stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=10))
    return loads


def _wait_roles(http_port: int, want: list[str], timeout: float = 60) -> None:
    """Until the proxy has polled every LM worker's role (else a request may run whole)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = f"http://127.0.0.1:{http_port}/dashboard/state"
        with urllib.request.urlopen(url, timeout=5) as reply:
            state = json.loads(reply.read())
        roles = sorted(
            w["load"]["role"] for w in state["workers"] if w["role"] == "lm" and w["load"]
        )
        if roles == sorted(want):
            return
        time.sleep(0.2)
    raise SystemExit(f"the proxy did not see LM roles {want} within {timeout:.0f}s")


def _start(topology: str, model_dir: Path, args) -> LocalCluster:
    http_port = args.http_port or free_port()
    overrides = {
        "model.path": str(model_dir),
        "proxy.grpc_port": args.grpc_port or free_port(),
        "proxy.http_port": http_port,
        "lm.kv_cache_bytes": 256 << 20,
        "lm.max_num_batched_tokens": args.max_num_batched_tokens,
        "lm.kv_connector": "auto" if topology == "both" else args.kv_connector,
        "lm.kv_send_layerwise": topology != "pd-steps",
    }
    config = load_config(None, overrides)
    if topology == "both":
        cluster = LocalCluster(config, num_encoders=1, num_lm_workers=2)
        roles = ["both", "both"]
    else:
        cluster = LocalCluster(
            config, num_encoders=1, num_lm_workers=0, num_prefill_workers=1, num_decode_workers=1
        )
        roles = ["prefill", "decode"]
    cluster.start()
    try:
        _wait_roles(http_port, roles)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def run_topologies(topologies: list[str], model_dir: Path, args) -> list[dict]:
    """Every topology's cluster up, then `args.rounds` rounds of the load on each in turn
    (the order reversed every other round), samples pooled per topology."""
    if args.rounds > 1 and (args.grpc_port or args.http_port):
        raise SystemExit("--rounds > 1 keeps every cluster up: leave the ports to be chosen")
    clusters: dict[str, LocalCluster] = {}
    samples = {
        t: {"wall_s": 0.0, "short_ttft": [], "short_itl": [], "long_ttft": []} for t in topologies
    }
    rows = []
    try:
        for topology in topologies:
            clusters[topology] = _start(topology, model_dir, args)
        for round_ in range(args.rounds):
            order = topologies if round_ % 2 == 0 else list(reversed(topologies))
            for topology in order:
                got = asyncio.run(_workload(clusters[topology].proxy.address, args, round_))
                for key, value in got.items():
                    samples[topology][key] += value
        for topology in topologies:
            row = {"topology": topology, **_summarize(samples[topology])}
            loads = _lm_loads(clusters[topology])
            sent = sum(x.kv_bytes_sent for x in loads)
            seconds = sum(x.kv_send_seconds for x in loads)
            row["kv_bytes_sent"] = sent
            row["kv_blocks_pulled"] = sum(x.kv_blocks_pulled for x in loads)
            row["kv_transfer_gbps"] = round(sent / seconds / 1e9, 3) if seconds else None
            print(_line(row), flush=True)
            rows.append(row)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return rows


def _line(row: dict) -> str:
    s = (
        f"{row['topology']:<8} short ITL p50/p99 {row['short_itl_ms']['p50']}/"
        f"{row['short_itl_ms']['p99']} ms  short TTFT p50/p99 {row['short_ttft_ms']['p50']}/"
        f"{row['short_ttft_ms']['p99']} ms  long TTFT p50/p99 {row['long_ttft_ms']['p50']}/"
        f"{row['long_ttft_ms']['p99']} ms  ({row['short_requests']} short requests)"
    )
    if row.get("kv_bytes_sent"):
        s += f"  KV {row['kv_bytes_sent'] / 1e6:.1f} MB at {row['kv_transfer_gbps']} GB/s"
    return s


# -- the handover probe: layer by layer vs after each step, one process -----------------------


def handover_probe(model_dir: Path, args) -> dict:
    """Long text prompts handed over from a prefill engine to a KV receiver on loopback, with
    lm.kv_send_layerwise on and off, alternating request by request (see the module doc)."""
    family = load_family(model_dir)
    rng = np.random.default_rng(0)
    vocab = family.text.vocab_size
    out: dict[str, dict] = {}
    with EmbeddedRedis() as server:
        inbox = KVInbox(1 << 30)
        receiver = KVReceiver("127.0.0.1", 0, inbox, peek_key)
        target = f"127.0.0.1:{receiver.port}"
        engines = {}
        try:
            for side, layerwise in (("layerwise", True), ("steps", False)):
                lm = LMConfig(
                    block_size=16,
                    kv_cache_bytes=256 << 20,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_connector="direct",
                    kv_send_layerwise=layerwise,
                )
                store = KVStore(server.url, "bench-pd", namespace=side, ttl_seconds=60)
                engines[side] = build_engine(
                    lm,
                    family,
                    torch.float32,
                    registry=None,
                    kv_store=store,
                    kv_direct=(KVSender(), None),
                )
            times = {side: ([], []) for side in engines}
            for i in range(-1, args.handover_rounds):  # round -1: warm-up, not counted
                prompt = rng.integers(100, vocab - 100, args.handover_tokens).tolist()
                order = list(engines) if i % 2 == 0 else list(reversed(engines))
                for side in order:
                    total, after = _handover(engines[side], prompt, f"{side}-{i}", target)
                    inbox.clear()
                    if i >= 0:
                        times[side][0].append(total)
                        times[side][1].append(after)
            for side, engine in engines.items():
                counts = kv_counters(engine.kv)
                seconds = counts["kv_send_seconds"]
                out[side] = {
                    "handover_ms": _pct(times[side][0]),
                    "after_forward_ms": _pct(times[side][1]),
                    "kv_bytes_sent": counts["kv_bytes_sent"],
                    "kv_send_gbps": round(counts["kv_bytes_sent"] / seconds / 1e9, 3)
                    if seconds
                    else None,
                }
        finally:
            for engine in engines.values():
                engine.kv.close()
            receiver.close()
    a, b = out["layerwise"]["handover_ms"], out["steps"]["handover_ms"]
    out["layerwise_vs_steps"] = {
        q: round(a[q] / b[q], 3) if a[q] and b[q] else None for q in ("p50", "p99")
    }
    out["tokens"] = args.handover_tokens
    out["rounds"] = args.handover_rounds
    return out


def _handover(engine, prompt: list[int], request_id: str, target: str) -> tuple[float, float]:
    """(request in -> first token and every block acknowledged, first token -> acknowledged)
    in seconds, for one prefill stage sent to `target`."""
    request = Request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    engine.kv.prefetch(request, handover=True, target=target)
    tokens: list = []
    engine.add_request(request, tokens.append)
    engine.run_to_completion()
    sampled = time.perf_counter()
    for future in engine.kv.pending_saves(request_id):
        future.result(timeout=60)
    done = time.perf_counter()
    if not tokens:
        raise RuntimeError(f"{request_id} gave no token")
    return done - started, done - sampled


def _probe_line(probe: dict) -> str:
    parts = []
    for side in ("layerwise", "steps"):
        row = probe[side]
        parts.append(
            f"{side} {row['handover_ms']['p50']}/{row['handover_ms']['p99']} ms "
            f"(after the forward {row['after_forward_ms']['p50']}/"
            f"{row['after_forward_ms']['p99']} ms, {row['kv_send_gbps']} GB/s)"
        )
    ratio = probe["layerwise_vs_steps"]
    return (
        f"handover of {probe['tokens']} tokens, p50/p99 over {probe['rounds']} rounds: "
        + "; ".join(parts)
        + f"; layerwise / steps {ratio['p50']}x / {ratio['p99']}x"
    )


# -- raw rates of the paths a block can take ---------------------------------------------------


def raw_rates(block_bytes: int, total_bytes: int) -> dict[str, float]:
    """GB/s of Redis SET / GET (pipelined batches), the direct socket and a gRPC client
    stream, moving `total_bytes` in values of `block_bytes`, on loopback."""
    n = max(total_bytes // block_bytes, 8)
    floats = block_bytes // 4
    tensor = torch.randn(floats)
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    values = [encode_block(h, tensor.view(1, -1), 16) for h in hashes]
    moved = sum(len(v) for v in values)
    batch = 32
    out = {}
    with EmbeddedRedis() as server:
        store = KVStore(server.url, "bench", ttl_seconds=60)
        started = time.perf_counter()
        for i in range(0, n, batch):
            store.put_many(list(zip(hashes[i : i + batch], values[i : i + batch], strict=True)))
        out["redis_set_gbps"] = moved / (time.perf_counter() - started) / 1e9
        started = time.perf_counter()
        for i in range(0, n, batch):
            store.get_many(hashes[i : i + batch])
        out["redis_get_gbps"] = moved / (time.perf_counter() - started) / 1e9
        store.close()
    inbox = KVInbox(moved * 2)
    receiver = KVReceiver("127.0.0.1", 0, inbox, peek_key)
    sender = KVSender()
    try:
        address = f"127.0.0.1:{receiver.port}"
        sender.send(address, values[:1])
        started = time.perf_counter()
        for i in range(0, n, batch):
            sender.send(address, values[i : i + batch])
        out["socket_gbps"] = moved / (time.perf_counter() - started) / 1e9
    finally:
        sender.close()
        receiver.close()
    out["grpc_stream_gbps"] = _grpc_rate(values, batch)
    return {k: round(v, 3) for k, v in out.items()}


def _grpc_rate(values: list[bytes], batch: int) -> float:
    """A client stream of raw bytes messages (no protobuf: identity serializers), one call per
    batch, as a gRPC transport of the same frames would do."""
    received = []

    def sink(request_iterator, context):
        received.append(sum(len(v) for v in request_iterator))
        return b"\x06"

    handler = grpc.method_handlers_generic_handler(
        "bench.KV", {"Send": grpc.stream_unary_rpc_method_handler(sink)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            send = channel.stream_unary("/bench.KV/Send")
            send(iter(values[:1]), timeout=60)
            started = time.perf_counter()
            for i in range(0, len(values), batch):
                send(iter(values[i : i + batch]), timeout=60)
            elapsed = time.perf_counter() - started
    finally:
        server.stop(None)
    return sum(len(v) for v in values) / elapsed / 1e9


def run(args: argparse.Namespace) -> int:
    topologies = [t.strip() for t in args.topology.split(",") if t.strip()]
    unknown = set(topologies) - set(TOPOLOGIES)
    if unknown:
        raise SystemExit(f"unknown topologies {sorted(unknown)}; choose from {TOPOLOGIES}")
    model_dir = Path(args.model) if args.model else ensure_bench_model()
    family = load_family(model_dir)
    text = family.text
    block_bytes = PagedAttention.bytes_per_block(
        text.num_layers, 16, text.num_kv_heads, text.head_dim, torch.float32
    )
    if "pd-steps" in topologies and args.kv_connector != "direct":
        raise SystemExit("pd-steps compares layer-by-layer sends: it needs --kv-connector direct")
    rows = run_topologies(topologies, model_dir, args)
    probe = None
    if args.handover_rounds:
        probe = handover_probe(model_dir, args)
        print(_probe_line(probe), flush=True)
    rates = raw_rates(block_bytes, args.raw_mb << 20)
    print(
        f"raw rates, {block_bytes / 1024:.0f} KiB blocks: Redis SET {rates['redis_set_gbps']} "
        f"GET {rates['redis_get_gbps']} GB/s, socket {rates['socket_gbps']} GB/s, gRPC stream "
        f"{rates['grpc_stream_gbps']} GB/s",
        flush=True,
    )
    summary = {
        "bench": "pd",
        "kv_connector": args.kv_connector,
        "streams": args.streams,
        "long_requests": args.long_requests,
        "image_size": args.image_size,
        "rounds": args.rounds,
        "block_bytes": block_bytes,
        "results": rows,
        "raw": rates,
    }
    by = {r["topology"]: r for r in rows}

    def ratios(ours: str, baseline: str) -> dict[str, float | None]:
        """`ours` over `baseline`, per latency metric and percentile."""
        out = {}
        for metric in ("short_itl_ms", "short_ttft_ms", "long_ttft_ms"):
            for q in ("p50", "p99"):
                a, b = by[ours][metric][q], by[baseline][metric][q]
                out[f"{metric}_{q}"] = round(a / b, 3) if a and b else None
        return out

    if "both" in by and "pd" in by:
        summary["pd_vs_both"] = ratios("pd", "both")
    if "pd" in by and "pd-steps" in by:
        summary["layerwise_vs_steps"] = ratios("pd", "pd-steps")
    if probe is not None:
        summary["handover"] = probe
    print(json.dumps(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pd", help="prefill / decode split vs LM workers doing both")
    p.add_argument("--model", help="checkpoint directory (default: the built-in small model)")
    p.add_argument(
        "--topology", default="both,pd", help="both,pd,pd-steps (default: both,pd, in turn)"
    )
    p.add_argument("--streams", type=int, default=4, help="steady short decode streams")
    p.add_argument("--short-tokens", type=int, default=32, help="output tokens per short request")
    p.add_argument("--long-requests", type=int, default=6, help="long image prompts")
    p.add_argument("--long-tokens", type=int, default=4, help="output tokens per long prompt")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--image-size", type=int, default=448, help="square image side in pixels")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="LM token budget per step"
    )
    p.add_argument(
        "--kv-connector", default="shared", choices=("shared", "direct"), help="pd's KV path"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of the load per topology, all clusters kept up, order alternated",
    )
    p.add_argument("--raw-mb", type=int, default=64, help="MiB moved by each raw-rate probe")
    p.add_argument(
        "--handover-rounds",
        type=int,
        default=6,
        help="handover probe rounds, layer by layer vs after each step (0: skip)",
    )
    p.add_argument(
        "--handover-tokens", type=int, default=1024, help="prompt tokens of each handover"
    )
    p.add_argument("--grpc-port", type=int, help="proxy gRPC port (default: a free one)")
    p.add_argument("--http-port", type=int, help="proxy HTTP port (default: a free one)")
    p.set_defaults(func=run)


__all__ = ["add_parser", "raw_rates", "run"]
