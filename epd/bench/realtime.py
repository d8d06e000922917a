"""`epd bench realtime`: concurrent realtime audio sessions at real-time pace, two topologies
side by side on the same checkpoint, clip and cores:

- `e+pd`: a local cluster (embedded Redis, an encoder worker, an LM worker, the proxy); each
  session is one gRPC Inference.Realtime call (audio -> EncodeStream -> the session's Redis
  Stream -> the LM worker's blocking reader -> decode steps -> deltas);
- `aggregated`: one process that encodes and decodes itself: the family's streaming encoder
  (`open_stream`) and the LM engine with `append_realtime`, no network, no Redis.

Each session streams the same speech-like clip in 80 ms chunks, paced at real time. Per chunk:
its latency, from the chunk being sent to the first delta whose audio covers its end (the
model's own transcription delay is not in it: a delta covers the positions it has read). Per
session: its real-time factor, (first chunk sent -> last delta) / audio seconds (about 1.0
when it keeps up at real-time pace; above it, the session falls behind). Prints a line per
topology and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from common.config import LMConfig, load_config
from epd.launcher import LocalCluster
from lm_worker.engine import RequestOutput, deliver
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import MMFeature, SamplingParams, load_family
from proto import epd_pb2, epd_pb2_grpc

TOPOLOGIES = ("e+pd", "aggregated")
RATE = 16000
CHUNK = 1280  # 80 ms


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """Voiced-sounding noise: a few harmonics with a slow envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 110 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    wave = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 2.3 * t) ** 2
    wave = 0.2 * wave * envelope + 0.01 * rng.standard_normal(t.shape)
    return wave.astype(np.float32)


@dataclass
class SessionResult:
    sent: list[tuple[float, float]] = field(default_factory=list)  # (audio end s, time sent)
    deltas: list[tuple[float, float]] = field(default_factory=list)  # (audio covered, time)
    tokens: int = 0
    started: float = 0.0
    ended: float = 0.0

    def chunk_latencies(self) -> list[float]:
        out, j = [], 0
        for end, sent in self.sent:
            while j < len(self.deltas) and self.deltas[j][0] + 1e-9 < end:
                j += 1
            if j == len(self.deltas):
                break
            out.append(max(0.0, self.deltas[j][1] - sent))
        return out


async def paced_chunks(samples: np.ndarray, pace: bool):
    """(chunk, audio seconds at its end), at real time when `pace`."""
    start = time.monotonic()
    for i in range(0, samples.shape[0], CHUNK):
        chunk = samples[i : i + CHUNK]
        end = (i + chunk.shape[0]) / RATE
        if pace:
            await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))
        yield chunk, end


# -- e+pd ---------------------------------------------------------------------------------------


async def cluster_session(stub, samples: np.ndarray, pace: bool) -> SessionResult:
    result = SessionResult(started=time.monotonic())

    async def requests():
        yield epd_pb2.RealtimeRequest(
            config=epd_pb2.RealtimeConfig(
                format=epd_pb2.AUDIO_FORMAT_PCM_F32LE,
                sample_rate=RATE,
                sampling=epd_pb2.SamplingParams(temperature=0.0),
            )
        )
        async for chunk, end in paced_chunks(samples, pace):
            result.sent.append((end, time.monotonic()))
            yield epd_pb2.RealtimeRequest(audio=chunk.tobytes())
        yield epd_pb2.RealtimeRequest(input_done=epd_pb2.RealtimeInputDone())

    async for r in stub.Realtime(requests(), timeout=600):
        now = time.monotonic()
        if r.token_ids:
            result.tokens += len(r.token_ids)
            result.deltas.append((r.audio_seconds, now))
    result.ended = time.monotonic()
    return result


async def run_cluster(args, model_dir: Path, samples: np.ndarray) -> list[SessionResult]:
    overrides = {
        "model.path": str(model_dir),
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
        "lm.max_num_seqs": max(args.sessions, 4),
        "lm.kv_cache_bytes": 256 << 20,
    }
    config = load_config(None, {k: v for k, v in overrides.items() if v is not None})
    cluster = LocalCluster(config, num_encoders=1, num_lm_workers=1)
    await asyncio.to_thread(cluster.start)
    try:
        async with grpc.aio.insecure_channel(cluster.proxy.address) as channel:
            stub = epd_pb2_grpc.InferenceStub(channel)
            await cluster_session(stub, samples[: RATE // 2], pace=False)  # warm up
            return await asyncio.gather(
                *(cluster_session(stub, samples, pace=True) for _ in range(args.sessions))
            )
    finally:
        await asyncio.to_thread(cluster.stop)


# -- aggregated ---------------------------------------------------------------------------------


class Aggregated:
    """One process: the streaming encoder and the LM engine, realtime sessions in between."""

    def __init__(self, model_dir: Path, sessions: int):
        self.family = load_family(model_dir)
        self.encoder = self.family.load_encoder(torch.float32, torch.device("cpu"))
        self.loop = asyncio.get_running_loop()

        def emit(items):
            self.loop.call_soon_threadsafe(deliver, items)

        lm = LMConfig(max_num_seqs=max(sessions, 4), kv_cache_bytes=256 << 20)
        self.engine = build_engine(lm, self.family, torch.float32, emit, registry=None)
        self.engine.start()
        self.prompt = self.family.realtime_prompt()
        self.n = 0

    def close(self) -> None:
        self.engine.stop()

    async def session(self, samples: np.ndarray, pace: bool) -> SessionResult:
        self.n += 1
        sid = f"agg-{self.n}"
        result = SessionResult(started=time.monotonic())
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        positions = self.family.realtime_positions(samples.shape[0] / RATE + 1.0)
        request = Request(
            sid,
            list(self.prompt),
            SamplingParams(temperature=0.0),
            [MMFeature(sid, 0, positions, modality="audio")],
            realtime_session=sid,
        )
        self.engine.add_request(request, outputs.put_nowait)
        stream = self.encoder.open_stream()
        published = 0

        async def feed() -> None:
            nonlocal published
            async for chunk, end in paced_chunks(samples, pace):
                result.sent.append((end, time.monotonic()))
                rows = await asyncio.to_thread(stream.push, chunk)
                published += rows.shape[0]
                self.engine.append_realtime(sid, rows)
            rows = await asyncio.to_thread(stream.finish)
            self.engine.append_realtime(sid, rows, closed=True)

        feeder = asyncio.create_task(feed())
        audio = 0.0
        try:
            while True:
                out = await outputs.get()
                now = time.monotonic()
                if out.token_ids:
                    result.tokens += len(out.token_ids)
                    covered = self.family.realtime_audio_seconds(
                        len(self.prompt) + result.tokens - 1
                    )
                    audio = max(audio, min(covered, samples.shape[0] / RATE))
                    result.deltas.append((audio, now))
                if out.finish_reason is not None:
                    break
        finally:
            await feeder
            self.engine.abort(sid)  # a no-op once it finished
        result.ended = time.monotonic()
        return result


async def run_aggregated(args, model_dir: Path, samples: np.ndarray) -> list[SessionResult]:
    server = Aggregated(model_dir, args.sessions)
    try:
        await server.session(samples[: RATE // 2], pace=False)  # warm up
        return await asyncio.gather(
            *(server.session(samples, pace=True) for _ in range(args.sessions))
        )
    finally:
        server.close()


# -- the report ---------------------------------------------------------------------------------


def summarize(topology: str, results: list[SessionResult], seconds: float) -> dict:
    latencies = np.array([x for r in results for x in r.chunk_latencies()]) * 1e3
    rtf = [(r.ended - r.started) / seconds for r in results]

    def pct(q: float) -> float | None:
        return round(float(np.percentile(latencies, q)), 1) if latencies.size else None

    return {
        "topology": topology,
        "sessions": len(results),
        "audio_seconds": seconds,
        "chunks_measured": int(latencies.size),
        "chunk_latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99)},
        "rtf": {"mean": round(float(np.mean(rtf)), 3), "max": round(float(np.max(rtf)), 3)},
        "tokens_per_session": [r.tokens for r in results],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args) -> int:
    topologies = [t.strip() for t in args.topology.split(",") if t.strip()]
    bad = [t for t in topologies if t not in TOPOLOGIES]
    if bad:
        raise SystemExit(f"unknown topology {bad}; choose from {', '.join(TOPOLOGIES)}")
    with tempfile.TemporaryDirectory(prefix="epd-bench-rt-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            from models.testing import make_checkpoint

            model_dir = make_checkpoint(Path(tmp) / "voxtral", "voxtral_realtime", args.size)
        samples = speech_like(args.seconds, args.seed)
        rows = []
        for topology in topologies:
            runner = run_cluster if topology == "e+pd" else run_aggregated
            results = asyncio.run(runner(args, model_dir, samples))
            row = summarize(topology, results, args.seconds)
            rows.append(row)
            lat = row["chunk_latency_ms"]
            print(
                f"{topology:<10} {row['sessions']} sessions x {args.seconds:g} s  chunk latency "
                f"p50/p90/p99 {lat['p50']}/{lat['p90']}/{lat['p99']} ms  RTF mean "
                f"{row['rtf']['mean']} max {row['rtf']['max']}",
                flush=True,
            )
    report = {
        "bench": "realtime",
        "model": str(args.model or f"random voxtral_realtime ({args.size})"),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "chunk_ms": CHUNK * 1000 // RATE,
        "results": rows,
    }
    by = {r["topology"]: r for r in rows}
    if "e+pd" in by and "aggregated" in by:
        a, b = by["e+pd"]["chunk_latency_ms"], by["aggregated"]["chunk_latency_ms"]
        if a["p50"] and b["p50"]:
            report["e+pd_over_aggregated_p50"] = round(a["p50"] / b["p50"], 2)
    print(json.dumps(report))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "realtime", help="realtime audio sessions: per-chunk latency, RTF; e+pd vs aggregated"
    )
    p.add_argument("--model", help="a Voxtral Realtime checkpoint (default: a random one)")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"), help="random model size")
    p.add_argument("--topology", default="e+pd,aggregated", help="e+pd, aggregated (both)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (4)")
    p.add_argument("--seconds", type=float, default=4.0, help="clip length in seconds (4)")
    p.add_argument("--grpc-port", type=int, help="e+pd proxy gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, help="e+pd proxy HTTP port (default 8000)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
