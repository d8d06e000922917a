"""`epd bench serve`: serving under load, in the manner of vLLM's benchmark_serving and
SGLang's bench_serving.

Open-loop arrivals (Poisson at each `--request-rate`, or all at once with `inf`) of a synthetic
multimodal chat dataset (images of a controlled size, a share of requests whose image was seen
before, prompt and output lengths) or a JSONL file of requests, against each topology in turn on
the same cores and model:

- `e+pd`: a local cluster (the `epd up` launcher: embedded Redis, encoders, LM workers, the
  proxy), requests over gRPC, or `--target` a running proxy;
- `e+p+d`: the same with the LM split into prefill and decode workers (`--prefill-workers`,
  `--decode-workers`; the KV goes between them through `lm.kv_connector`);
- `aggregated`: one process that encodes its own media and decodes, with an in-process
  embedding cache: what a plain single server does, built from the same model code (the
  family's processor and encoder, the LM engine).

Encoders: `--encoders 1,3,auto:1:4` runs `e+pd` once per setting, a fixed count or the encoder
planner's (proxy/planner.py, as `epd up --encoders auto` runs it), each row with the
encoder-seconds it used (encoder processes alive, sampled over the load). `--rate-schedule
4:20,16:20,4:20` sends a load that steps (requests/s : seconds, Poisson within a step) instead
of `--request-rate`, and reports TTFT per step.

Per topology, rate and reuse ratio: throughput, goodput (requests meeting the TTFT and TPOT
targets), time to first token, inter-token latency, time per output token and end-to-end
latency at p50 / p90 / p99, the share of images served from the cache, and where a request's
time went: each role's stages (common/tracing.py), mean seconds per request. In a cluster those
come from `epd_stage_seconds` on the proxy's /metrics and every worker's metrics port (the bench
gives each worker one), the difference of the sums across the point; in `aggregated`, from the
server's own clocks (its preprocessing and encoding, and the LM request's queue, prefill chunks
and decode, as the LM worker measures them). A progress line runs on stderr; `--plot out.png`
draws latency against request rate per topology. The last line is one JSON object.

`--device` (auto: CUDA when there is one) is where every role the bench starts runs (the
cluster's encoders and LM workers through `encoder.device` / `lm.device`, the aggregated server
in process); `--size 3b` / `7b` serves a random checkpoint of Qwen2.5-VL-3B's / -7B's shapes in
bf16 (drawn on the GPU when the roles run on one), `small` (the default) the random small model.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from common.config import LMConfig, load_config
from common.device import resolve_device
from common.process import free_port
from common.served_model import ServedModel
from common.server import GRPC_OPTIONS
from encoder_worker.tower import Tower
from epd.bench import add_checkpoint_arguments, bench_checkpoint
from epd.launcher import LocalCluster, parse_encoders
from lm_worker.engine import LMEngine, RequestOutput, deliver
from lm_worker.loader import build_engine
from lm_worker.server import to_request
from models import MediaInput, load_family
from proto import epd_pb2, epd_pb2_grpc
from proxy.prepare import ChatMessage, Part, RequestBuilder

TOPOLOGIES = ("e+pd", "e+p+d", "aggregated")
# Each LM worker's KV cache: a fixed budget, not lm.kv_cache_bytes' auto (90% of the GPU memory
# free when the worker loads), since every role the bench starts shares the one device.
KV_CACHE_BYTES = {"cpu": 512 << 20, "cuda": 4 << 30}
WORDS = (
    "describe",
    "the",
    "picture",
    "colours",
    "shapes",
    "light",
    "corner",
    "left",
    "right",
    "top",
    "bottom",
    "what",
    "where",
    "how",
    "many",
    "objects",
    "background",
    "scene",
    "detail",
    "texture",
    "small",
    "large",
    "near",
    "far",
    "bright",
    "dark",
    "red",
    "green",
    "blue",
)


@dataclass(frozen=True)
class BenchRequest:
    text: str
    images: tuple[bytes, ...]
    max_tokens: int
    reused: bool  # every image was seen before (the dataset's reuse ratio counts these)


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    images: int = 0
    images_held: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# -- the dataset ---------------------------------------------------------------------------------


def noise_png(width: int, height: int, rng: random.Random) -> bytes:
    """A PNG of random blocks: every image differs, and decodes like a photo's worth of pixels."""
    blocks = np.random.default_rng(rng.getrandbits(32)).integers(
        0, 256, (max(height // 8, 1), max(width // 8, 1), 3), dtype=np.uint8
    )
    image = Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def synthetic(args: argparse.Namespace, reuse: float, seed: int) -> list[BenchRequest]:
    """`--num-requests` chat requests; a `reuse` share of them bring images sent before (in this
    set)."""
    rng = random.Random(seed)
    width, height = args.image_width, args.image_height
    pool: list[bytes] = []
    out = []
    n = args.num_requests
    # Exactly round(reuse * n) requests bring seen images (never the first: nothing is seen).
    reusing = set(rng.sample(range(1, n), min(round(reuse * n), n - 1))) if n > 1 else set()
    for i in range(n):
        reused = i in reusing
        images = []
        for _ in range(args.images_per_request):
            if reused:
                images.append(rng.choice(pool))
            else:
                images.append(noise_png(width, height, rng))
                pool.append(images[-1])
        words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        out.append(BenchRequest(f"Request {i}: {words}", tuple(images), args.output_tokens, reused))
    return out


def from_jsonl(path: str) -> list[BenchRequest]:
    """One request per line: {"prompt": str, "images": [file paths], "max_tokens": int}."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            images = tuple(Path(p).read_bytes() for p in row.get("images", []))
            out.append(BenchRequest(str(row["prompt"]), images, int(row["max_tokens"]), False))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}:{n}: not a request ({e})") from None
    return out


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Open-loop send times in seconds from the start: Poisson at `rate` requests/s."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def parse_schedule(text: str) -> list[tuple[float, float]]:
    """`--rate-schedule` "4:20,16:20": [(requests/s, seconds), ...]."""
    try:
        steps = [tuple(float(x) for x in step.split(":")) for step in text.split(",")]
        if any(len(step) != 2 or step[0] <= 0 or step[1] <= 0 for step in steps):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--rate-schedule: RATE:SECONDS,... (4:20,16:20), got {text!r}") from None
    return steps


def schedule_arrivals(steps: list[tuple[float, float]], seed: int) -> list[float]:
    """Open-loop send times: Poisson at each step's rate for its seconds, one after another."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for rate, seconds in steps:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            out.append(t)
            t += rng.expovariate(rate)
        start += seconds
    return out


# -- the topologies ------------------------------------------------------------------------------


class ClusterClient:
    """A running proxy over gRPC."""

    def __init__(self, target: str):
        self.channel = grpc.aio.insecure_channel(target, options=GRPC_OPTIONS)
        self.stub = epd_pb2_grpc.InferenceStub(self.channel)

    async def generate(self, request: BenchRequest) -> AsyncIterator[tuple[int, int, int]]:
        """(new tokens, images, images held) per response."""
        msg = epd_pb2.GenerateRequest(
            sampling=epd_pb2.SamplingParams(
                max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
            )
        )
        parts = []
        for image in request.images:
            msg.media.add(image=image)
            parts.append(epd_pb2.ContentPart(media_index=len(msg.media) - 1))
        parts.append(epd_pb2.ContentPart(text=request.text))
        msg.chat.messages.add(role="user", content=parts)
        async for response in self.stub.Generate(msg, timeout=600):
            yield len(response.token_ids), response.usage.mm_items, response.usage.mm_items_held

    async def close(self) -> None:
        await self.channel.close()


class AggregatedServer:
    """One process that encodes and decodes: the family's processor and encoder run in the
    request's path (one encoder thread), their outputs kept in an in-process cache, then the
    LM engine (its own thread) prefills and decodes, batching requests continuously."""

    def __init__(self, model_dir: Path, lm: LMConfig):
        family = load_family(model_dir)
        dtype = family.dtype
        served = ServedModel(model_dir, "aggregated", dtype, family.fingerprint(dtype), family)
        self.builder = RequestBuilder(served)
        device = resolve_device(lm.device, "lm.device")
        self.tower = Tower(family.processor(), family.load_encoder(dtype, device))
        self.cache: dict[str, object] = {}
        self.encode_thread = ThreadPoolExecutor(1, thread_name_prefix="aggregated-encoder")
        self.engine: LMEngine | None = None
        self.lm = lm
        self.family = family
        self.count = 0
        self.stages = ClockedStages("aggregated")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def emit(items):
            loop.call_soon_threadsafe(deliver, items)

        self.engine = build_engine(self.lm, self.family, self.family.dtype, emit, registry=None)
        self.engine.start()

    async def generate(self, request: BenchRequest) -> AsyncIterator[tuple[int, int, int]]:
        self.count += 1
        media = [MediaInput("image", image=image) for image in request.images]
        parts = [Part(media_index=i) for i in range(len(media))] + [Part(text=request.text)]
        sampling = epd_pb2.SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
        )
        prepared = await self._on_encoder_thread(
            "preprocess",
            self.builder.build,
            [ChatMessage("user", tuple(parts))],
            media,
            sampling,
            f"agg-{self.count}",
        )
        held = sum(item.mm_hash in self.cache for item in prepared.items)
        embeddings = await self._on_encoder_thread("encode", self._encode, prepared)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        lm_request = to_request(prepared.lm_request())
        self.engine.add_request(lm_request, queue.put_nowait, embeddings)
        while True:
            out = await queue.get()
            if out.error:
                raise RuntimeError(out.error)
            if out.finish_reason is not None:
                for stage in lm_request.stages:  # as an LM worker records them
                    self.stages.add(stage.name, stage.seconds)
            yield len(out.token_ids), len(prepared.items), held
            if out.finish_reason is not None:
                return

    async def _on_encoder_thread(self, stage: str, fn, *args):
        """`fn(*args)` on the encoder thread: its time there is `stage`, its wait for the
        thread `encoder_wait`."""

        def timed():
            began = time.perf_counter()
            return fn(*args), began, time.perf_counter()

        submitted = time.perf_counter()
        loop = asyncio.get_running_loop()
        out, began, ended = await loop.run_in_executor(self.encode_thread, timed)
        self.stages.add("encoder_wait", began - submitted)
        self.stages.add(stage, ended - began)
        return out

    def _encode(self, prepared) -> dict:
        missing = [i for i in prepared.items if i.mm_hash not in self.cache]
        if missing:
            outputs = self.tower.run([self.tower.prepare(i.media) for i in missing])
            for item, out in zip(missing, outputs, strict=True):
                self.cache[item.mm_hash] = self.engine.load_embedding(
                    item.mm_hash, out, out.shape[0]
                )
        return {i.mm_hash: self.cache[i.mm_hash] for i in prepared.items}

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        self.encode_thread.shutdown()


# -- where a request's time went -----------------------------------------------------------------

# Each role's stages in the order a request meets them (common/tracing.py); any other follows.
STAGE_ORDER = {
    "proxy": ("validate", "cache_check", "encode", "lm_call"),
    "encoder": ("held_check", "preprocess", "queue_wait", "tower", "publish"),
    "lm": (
        "kv_prefetch",
        "embedding_wait",
        "fetch",
        "queue_wait",
        "prefill_chunk",
        "decode",
        "kv_send",
    ),
    "aggregated": ("encoder_wait", "preprocess", "encode", "queue_wait", "prefill_chunk", "decode"),
}
# The groups a breakdown reports, in request order; prefill and decode workers are LM workers.
GROUPS = ("proxy", "encoder", "lm", "prefill", "decode", "aggregated")
GROUP_ROLE = {"prefill": "lm", "decode": "lm"}
METRICS_PORT_ENV = {"encoder": "EPD_ENCODER_METRICS_PORT", "lm": "EPD_LM_METRICS_PORT"}
STAGES_NOTE = (
    "stages.seconds: the mean seconds a request of the point spent in each stage of each role "
    "(the stage's total over the point / requests sent); stages.per_request: the stage's "
    "observations per request (encoder stages count per image, prefill_chunk per chunk, lm_call "
    "per LM call: 2 in e+p+d). A role's stage holds its callees': the proxy's encode spans the "
    "encoder's stages, its lm_call the LM worker's."
)

Totals = dict[tuple[str, str], tuple[float, float]]  # (group, stage) -> (seconds, observations)


class StageTotals:
    """Where a point's breakdown comes from: here nothing (a --target proxy, whose /metrics
    address the bench does not know)."""

    source = "none: a --target proxy (the bench does not know its /metrics)"

    async def totals(self) -> Totals:
        return {}


class ScrapedStages(StageTotals):
    """`epd_stage_seconds` sums and counts read off each role's /metrics, the workers of a group
    (encoders, LM workers, prefill or decode workers) added up."""

    source = "epd_stage_seconds from the proxy's /metrics and every worker's metrics port"

    def __init__(self, urls: dict[str, list[str]]):
        self.urls = urls  # group -> its roles' /metrics

    async def totals(self) -> Totals:
        """Once two reads 0.2 s apart agree (for at most 5 s): a role observes a request's
        stages just after its last message leaves, so a read right after the load can miss the
        last few."""
        last = await asyncio.to_thread(self._read)
        for _ in range(25):
            await asyncio.sleep(0.2)
            now = await asyncio.to_thread(self._read)
            if now == last:
                break
            last = now
        return last

    def _read(self) -> Totals:
        out: dict[tuple[str, str], list[float]] = {}
        for group, urls in self.urls.items():
            for url in urls:
                with urllib.request.urlopen(url, timeout=10) as reply:
                    text = reply.read().decode()
                for family in text_string_to_metric_families(text):
                    if family.name != "epd_stage_seconds":
                        continue
                    for sample in family.samples:
                        kind = sample.name.removeprefix(family.name)
                        if kind in ("_sum", "_count"):
                            total = out.setdefault((group, sample.labels["stage"]), [0.0, 0.0])
                            total[kind == "_count"] += sample.value
        return {key: (seconds, count) for key, (seconds, count) in out.items()}


class ClockedStages(StageTotals):
    """Stages a process times itself (the aggregated server: one process, no /metrics)."""

    source = "the aggregated server's own clocks (one process: no /metrics)"

    def __init__(self, group: str):
        self.group = group
        self._totals: dict[tuple[str, str], list[float]] = {}

    def add(self, stage: str, seconds: float) -> None:
        total = self._totals.setdefault((self.group, stage), [0.0, 0.0])
        total[0] += max(seconds, 0.0)
        total[1] += 1

    async def totals(self) -> Totals:
        return {key: (seconds, count) for key, (seconds, count) in self._totals.items()}


def stage_breakdown(before: Totals, after: Totals, requests: int) -> dict:
    """{group: {stage: mean seconds per request}} and {group: {stage: observations per
    request}} over what happened between `before` and `after`, in request order."""
    seconds: dict[str, dict[str, float]] = {}
    per_request: dict[str, dict[str, float]] = {}
    for group, stage in sorted(after, key=_stage_key):
        total, count = after[group, stage]
        total_before, count_before = before.get((group, stage), (0.0, 0.0))
        if count <= count_before:
            continue  # not run at this point
        seconds.setdefault(group, {})[stage] = round((total - total_before) / requests, 6)
        per_request.setdefault(group, {})[stage] = round((count - count_before) / requests, 3)
    return {"seconds": seconds, "per_request": per_request}


def _stage_key(key: tuple[str, str]) -> tuple:
    group, stage = key
    order = STAGE_ORDER.get(GROUP_ROLE.get(group, group), ())
    return (
        GROUPS.index(group) if group in GROUPS else len(GROUPS),
        group,
        order.index(stage) if stage in order else len(order),
        stage,
    )


# -- one run -------------------------------------------------------------------------------------


async def run_load(
    client,
    requests: list[BenchRequest],
    rate: float,
    seed: int,
    label: str,
    times: list[float] | None = None,
) -> tuple[list[Result], float]:
    """Send `requests` at their arrival times (`times`, or Poisson at `rate`); (results, wall
    seconds)."""
    times = arrivals(len(requests), rate, seed) if times is None else times
    results = [Result() for _ in requests]
    done = 0
    started = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal done
        await asyncio.sleep(max(started + times[i] - time.perf_counter(), 0))
        r, sent = results[i], time.perf_counter()
        last = sent
        try:
            async for tokens, images, held in client.generate(requests[i]):
                now = time.perf_counter()
                if tokens:
                    if r.output_tokens == 0:
                        r.ttft = now - sent
                    else:
                        r.itl.append(now - last)
                    r.output_tokens += tokens
                    last = now
                r.images, r.images_held = images, held
            r.ok = True
        except Exception as e:  # counted and reported; the run goes on
            r.error = f"{type(e).__name__}: {e}"
        r.e2e = time.perf_counter() - sent
        done += 1
        _progress(label, done, len(requests))

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    print(file=sys.stderr)
    return results, time.perf_counter() - started


def _progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    print(f"\r  {label:<40} [{bar}] {done}/{total}", end="", file=sys.stderr, flush=True)


def summarize(results: list[Result], wall: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        a = np.asarray(values) * 1e3
        return {
            "p50": round(float(np.percentile(a, 50)), 2),
            "p90": round(float(np.percentile(a, 90)), 2),
            "p99": round(float(np.percentile(a, 99)), 2),
            "mean": round(float(a.mean()), 2),
        }

    good = [r for r in ok if r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo)]
    images = sum(r.images for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_seconds": round(wall, 2),
        "throughput_rps": round(len(ok) / wall, 3),
        "output_tps": round(sum(r.output_tokens for r in ok) / wall, 2),
        "goodput_rps": round(len(good) / wall, 3),
        "ttft_ms": pct([r.ttft for r in ok]),
        "itl_ms": pct([x for r in ok for x in r.itl]),
        "tpot_ms": pct([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": pct([r.e2e for r in ok]),
        "cache_hit_rate": round(sum(r.images_held for r in ok) / images, 3) if images else None,
    }


class EncoderMeter:
    """Encoder processes alive during a load, sampled every `interval`: the encoder-seconds a
    run used. With --encoders auto it also runs the launcher's supervision pass meanwhile (what
    `epd up` runs in its main loop), which starts and drains encoders on the planner's answer."""

    def __init__(self, cluster: LocalCluster, interval: float = 0.25):
        self.cluster = cluster
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="encoder-meter", daemon=True)

    def _alive(self) -> int:
        return sum(r.child is not None and r.child.poll() is None for r in self.cluster.encoders)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            if self.cluster.auto:
                self.cluster.supervise(now)
            self.samples.append((now, self._alive()))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict:
        """Encoder-seconds over [start, end] (monotonic), and the mean and most encoders."""
        points = [(t, n) for t, n in self.samples if start <= t <= end]
        if not points:
            return {"encoder_seconds": None, "encoders_mean": None, "encoders_max": None}
        ends = [t for t, _ in points[1:]] + [end]
        seconds = sum(n * (min(t1, end) - t0) for (t0, n), t1 in zip(points, ends, strict=True))
        return {
            "encoder_seconds": round(seconds, 1),
            "encoders_mean": round(seconds / max(end - points[0][0], 1e-9), 2),
            "encoders_max": max(n for _, n in points),
        }


async def bench_topology(
    topology: str, args, model_dir: Path, datasets, encoders: str = "1"
) -> list[dict]:
    rows = []
    cluster = meter = None
    if topology == "aggregated":
        client = AggregatedServer(model_dir, _lm_config(args))
        client.start(asyncio.get_running_loop())
        stages = client.stages
    elif args.target and topology == "e+pd":
        client = ClusterClient(args.target)
        stages = StageTotals()
    else:
        cluster = await asyncio.to_thread(
            _start_cluster, args, model_dir, topology == "e+p+d", encoders
        )
        client = ClusterClient(cluster.proxy.address)
        stages = ScrapedStages(_metrics_urls(cluster))
        meter = EncoderMeter(cluster)
        meter.start()
    try:
        await _warm_up(client)
        if topology == "e+p+d":
            await _until_split(client, stages)
        for (rate, reuse), requests in datasets.items():
            label = f"{topology} rate {rate:g}/s reuse {reuse:g}"
            if topology == "e+pd":
                label += f" encoders {encoders}"
            before = await stages.totals()
            started = time.monotonic()
            results, wall = await run_load(client, requests, rate, args.seed, label, args.times)
            after = await stages.totals()
            row = {"topology": topology, "request_rate": rate, "reuse": reuse}
            if cluster is not None:
                row["encoders"] = encoders
                row |= meter.between(started, started + wall)
            row |= summarize(results, wall, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
            if args.times is not None:
                row["steps"] = _steps(args, results, meter, started)
            row["stages"] = {
                "source": stages.source,
                **stage_breakdown(before, after, len(requests)),
            }
            rows.append(row)
            print(_line(row), flush=True)
            print(_stage_line(row["stages"]), flush=True)
    finally:
        await client.close()
        if meter is not None:
            meter.stop()
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)
    return rows


def _steps(args, results: list[Result], meter: EncoderMeter | None, started: float) -> list:
    """Per step of the rate schedule: its requests' TTFT and the encoders meanwhile."""
    out, begin = [], 0.0
    for rate, seconds in args.schedule:
        mine = [
            r.ttft for r, t in zip(results, args.times, strict=True)
            if begin <= t < begin + seconds and r.ok
        ]  # fmt: skip
        step = {"rate": rate, "seconds": seconds, "requests": len(mine)}
        if mine:
            ms = np.asarray(mine) * 1e3
            step |= {
                "ttft_p50_ms": round(float(np.percentile(ms, 50)), 1),
                "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
            }
        if meter is not None:
            step |= meter.between(started + begin, started + begin + seconds)
        out.append(step)
        begin += seconds
    return out


async def _warm_up(client) -> None:
    """One request with a fresh image, so start-up costs stay out of the figures."""
    rng = random.Random(-1)
    warm = BenchRequest("warm up", (noise_png(64, 64, rng),), 2, False)
    async for _ in client.generate(warm):
        pass


async def _until_split(client, stages: StageTotals, timeout: float = 60.0) -> None:
    """More warm-ups until one runs in two LM calls (prefill, then decode): the proxy splits a
    request once both roles' load reports are in, a moment after the workers serve."""
    deadline = time.monotonic() + timeout
    while True:
        before = await stages.totals()
        await _warm_up(client)
        after = await stages.totals()
        key = ("proxy", "lm_call")
        if after.get(key, (0, 0))[1] - before.get(key, (0, 0))[1] >= 2:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"e+p+d: the proxy did not split a request in {timeout:g} s")
        await asyncio.sleep(0.5)


def _start_cluster(args, model_dir: Path, split: bool, encoders: str = "1") -> LocalCluster:
    overrides = {
        "model.path": str(model_dir),
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
        "proxy.encoder_scale_down_seconds": args.scale_down_seconds,
        "encoder.device": args.device,
        **{f"lm.{k}": v for k, v in _lm_settings(args).items()},
    }
    config = load_config(None, {k: v for k, v in overrides.items() if v is not None})
    count, auto = parse_encoders(encoders, config)
    if split:
        cluster = LocalCluster(
            config,
            num_encoders=count,
            num_lm_workers=0,
            num_prefill_workers=args.prefill_workers,
            num_decode_workers=args.decode_workers,
        )
    else:
        cluster = LocalCluster(
            config, num_encoders=count, num_lm_workers=args.lm_workers, encoders_auto=auto
        )
    # Each its own /metrics; not autoscaled encoders, which come and go (and take their counters
    # with them): their stages are left out of the breakdown.
    for role in [*([] if auto else cluster.encoders), *cluster.lm_workers]:
        role.env[METRICS_PORT_ENV[role.kind]] = str(free_port())
    cluster.start()
    return cluster


def _metrics_urls(cluster: LocalCluster) -> dict[str, list[str]]:
    """The /metrics of each group of a cluster `_start_cluster` started."""
    urls = {"proxy": [f"http://{cluster.host}:{cluster.config.proxy.http_port}/metrics"]}
    for role in [*cluster.encoders, *cluster.lm_workers]:
        if METRICS_PORT_ENV[role.kind] not in role.env:
            continue  # an autoscaled encoder
        group = role.name.rsplit("-", 1)[0]  # encoder, lm, prefill, decode
        host = role.address.rsplit(":", 1)[0]
        port = role.env[METRICS_PORT_ENV[role.kind]]
        urls.setdefault(group, []).append(f"http://{host}:{port}/metrics")
    return urls


def _lm_settings(args) -> dict:
    return {
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_bytes": KV_CACHE_BYTES[args.device_type],
    }


def _lm_config(args) -> LMConfig:
    return LMConfig(**_lm_settings(args))


def _line(row: dict) -> str:
    encoders = ""
    if row.get("encoder_seconds") is not None:
        encoders = (
            f"  encoders {row['encoders']}: {row['encoder_seconds']:g} encoder-s "
            f"(mean {row['encoders_mean']:g}, max {row['encoders_max']})"
        )
    steps = "".join(
        f"\n    step {s['rate']:g}/s x {s['seconds']:g} s: {s['requests']} requests, TTFT p50/p99 "
        f"{s.get('ttft_p50_ms')}/{s.get('ttft_p99_ms')} ms, encoders mean {s.get('encoders_mean')}"
        for s in row.get("steps", [])
    )
    return (
        f"{row['topology']:<10} rate {row['request_rate']:>5g}/s reuse {row['reuse']:<4g} "
        f"done {row['completed']}/{row['requests']}  {row['throughput_rps']:.2f} req/s "
        f"{row['output_tps']:.1f} tok/s goodput {row['goodput_rps']:.2f}/s  TTFT p50/p99 "
        f"{row['ttft_ms']['p50']}/{row['ttft_ms']['p99']} ms  ITL p50/p99 "
        f"{row['itl_ms']['p50']}/{row['itl_ms']['p99']} ms  cache {row['cache_hit_rate']}"
        + encoders
        + steps
    )


def _stage_line(stages: dict) -> str:
    """The point's stages, in request order: mean ms per request; (xN) where a stage ran other
    than once a request."""
    if not stages["seconds"]:
        return f"  stages: {stages['source']}"
    groups = []
    for group, means in stages["seconds"].items():
        parts = []
        for stage, seconds in means.items():
            n = stages["per_request"][group][stage]
            parts.append(
                f"{stage} {seconds * 1e3:.2f}" + ("" if abs(n - 1) < 0.05 else f" (x{n:g})")
            )
        groups.append(f"{group}: " + " ".join(parts))
    return (
        f"  stages, mean ms per request ({stages['source']}; (xN): times a request ran it): "
        + " | ".join(groups)
    )


def plot(rows: list[dict], path: str) -> None:
    """TTFT and ITL p50 / p99 against request rate, one line per topology and reuse ratio."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from e
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    series: dict[tuple, list[dict]] = {}
    for row in rows:
        series.setdefault((row["topology"], row["reuse"]), []).append(row)
    finite = [r["request_rate"] for r in rows if not math.isinf(r["request_rate"])]
    burst = max(finite, default=1.0) * 2  # where an all-at-once run is drawn
    panels = (
        (axes[0], "ttft_ms", "time to first token"),
        (axes[1], "itl_ms", "inter-token latency"),
    )
    # A colour per topology, a marker per reuse ratio; p50 solid, p99 dashed.
    colours = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(r["topology"] for r in rows))}
    markers = {r: m for r, m in zip(sorted({r["reuse"] for r in rows}), "os^Dv*", strict=False)}
    bursts = any(math.isinf(r["request_rate"]) for r in rows)
    for ax, metric, title in panels:
        for (topology, reuse), points in sorted(series.items()):
            xs = [burst if math.isinf(p["request_rate"]) else p["request_rate"] for p in points]
            for q, line in (("p50", "-"), ("p99", "--")):
                ys = [p[metric][q] for p in points]
                ax.plot(
                    xs,
                    ys,
                    line,
                    color=colours[topology],
                    marker=markers.get(reuse, "o"),
                    label=f"{topology}, reuse {reuse:g}, {q}",
                )
        rate = "request rate (requests/s"
        ax.set_xlabel(rate + ("; the last tick: all at once)" if bursts else ")"))
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    args.rates = [float(r) for r in args.request_rate.split(",")]
    args.times = None  # send times of a --rate-schedule (None: Poisson at each rate)
    if args.rate_schedule:
        args.schedule = parse_schedule(args.rate_schedule)
        args.times = schedule_arrivals(args.schedule, args.seed)
        if not args.times:
            raise SystemExit("--rate-schedule: no request falls within it")
        args.num_requests = len(args.times)
        args.rates = [round(len(args.times) / sum(s for _, s in args.schedule), 3)]
    settings = [e.strip() for e in args.encoders.split(",")]
    topologies = [t.strip() for t in args.topology.split(",")]
    unknown = set(topologies) - set(TOPOLOGIES)
    if unknown:
        raise SystemExit(f"unknown topologies {sorted(unknown)}; choose from {TOPOLOGIES}")
    try:
        args.device_type = resolve_device(args.device, "--device").type
    except RuntimeError:
        raise SystemExit("--device cuda: torch finds no CUDA device here") from None
    model_dir = bench_checkpoint(args, args.device_type)[0]
    # NOTE: a new synthetic set per rate and reuse ratio (new images), so that only the chosen
    # share of a run's requests finds its images cached; a JSONL set is replayed as it is.
    reuses = [0.0] if args.dataset else [float(r) for r in args.reuse.split(",")]
    datasets = {}
    for i, (rate, reuse) in enumerate((r, u) for u in reuses for r in args.rates):
        if args.dataset:
            datasets[rate, reuse] = from_jsonl(args.dataset)
        else:
            datasets[rate, reuse] = synthetic(args, reuse, args.seed + 1000 * i)
    rows = []
    for topology in topologies:
        for encoders in settings if topology == "e+pd" else settings[:1]:
            rows += asyncio.run(bench_topology(topology, args, model_dir, datasets, encoders))
    summary = {
        "bench": "serve",
        "model": model_dir.name,
        "device": args.device_type,
        "image": f"{args.image_width}x{args.image_height}",
        "images_per_request": args.images_per_request,
        "output_tokens": args.output_tokens,
        "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
        "stages_note": STAGES_NOTE,
        "rate_schedule": args.rate_schedule,
        "results": rows,
        "ratios": _ratios(rows),
        "encoders_vs": _encoder_ratios(rows),
    }
    if args.plot:
        plot(rows, args.plot)
        summary["plot"] = args.plot
    print(json.dumps(_finite(summary)))
    return 0


def _finite(value):
    """JSON has no infinity: an all-at-once rate is written "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ratios(rows: list[dict]) -> list[dict]:
    """Each disaggregated row (e+pd per encoder setting, e+p+d) over aggregated at the same rate
    and reuse (TTFT p50 / ITL p50 / goodput)."""
    bases = {(r["request_rate"], r["reuse"]): r for r in rows if r["topology"] == "aggregated"}
    out = []
    for row in rows:
        base = bases.get((row["request_rate"], row["reuse"]))
        if row["topology"] == "aggregated" or base is None:
            continue
        out.append(
            {
                "topology": row["topology"],
                **({"encoders": row["encoders"]} if "encoders" in row else {}),
                "request_rate": row["request_rate"],
                "reuse": row["reuse"],
                "ttft_p50_vs_aggregated": _ratio(row["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                "itl_p50_vs_aggregated": _ratio(row["itl_ms"]["p50"], base["itl_ms"]["p50"]),
                "goodput_vs_aggregated": _ratio(row["goodput_rps"], base["goodput_rps"]),
            }
        )
    return out


def _encoder_ratios(rows: list[dict]) -> list[dict]:
    """Each `e+pd` encoder setting over the first one at the same rate and reuse: TTFT p50 / p99
    and encoder-seconds (--encoders 1,auto: what the planner costs and gives against one)."""
    e_pd = [r for r in rows if r["topology"] == "e+pd" and "encoders" in r]
    first = e_pd[0]["encoders"] if e_pd else None
    bases = {(r["request_rate"], r["reuse"]): r for r in e_pd if r["encoders"] == first}
    out = []
    for row in e_pd:
        base = bases.get((row["request_rate"], row["reuse"]))
        if row["encoders"] == first or base is None:
            continue
        ttft, base_ttft = row["ttft_ms"], base["ttft_ms"]
        out.append(
            {
                "encoders": row["encoders"],
                "baseline": first,
                "request_rate": row["request_rate"],
                "reuse": row["reuse"],
                "ttft_p50": _ratio(ttft["p50"], base_ttft["p50"]),
                "ttft_p99": _ratio(ttft["p99"], base_ttft["p99"]),
                "encoder_seconds": _ratio(row["encoder_seconds"], base["encoder_seconds"]),
            }
        )
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serving under load: TTFT / ITL / goodput per topology")
    add_checkpoint_arguments(p)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the roles run (auto: CUDA when there is one)",
    )
    p.add_argument(
        "--topology",
        default="e+pd,aggregated",
        help="comma-separated: e+pd, e+p+d, aggregated (default: e+pd,aggregated)",
    )
    p.add_argument("--target", help="an already running proxy (host:port) for e+pd")
    p.add_argument("--request-rate", default="1,4", help="requests/s, comma-separated; inf")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate (32)")
    p.add_argument("--reuse", default="0,0.5", help="share of requests with seen images")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--image-width", type=int, default=448)
    p.add_argument("--image-height", type=int, default=448)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--dataset", help="JSONL requests instead of the synthetic set")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="goodput's TTFT target")
    p.add_argument("--tpot-slo-ms", type=float, default=200.0, help="goodput's TPOT target")
    p.add_argument(
        "--encoders",
        default="1",
        help="e+pd: encoder workers, or auto[:MIN:MAX] (the encoder planner); comma-separated "
        "settings run one after another (1,3,auto:1:4)",
    )
    p.add_argument(
        "--rate-schedule",
        help="RATE:SECONDS,... a load that steps (4:20,16:20,4:20) instead of --request-rate",
    )
    p.add_argument(
        "--scale-down-seconds",
        type=float,
        default=15.0,
        help="--encoders auto: proxy.encoder_scale_down_seconds (15; the config's default, 60, "
        "outlasts a short run)",
    )
    p.add_argument("--lm-workers", type=int, default=1, help="e+pd: LM workers")
    p.add_argument("--prefill-workers", type=int, default=1, help="e+p+d: prefill workers")
    p.add_argument("--decode-workers", type=int, default=1, help="e+p+d: decode workers")
    p.add_argument("--max-num-seqs", type=int, default=32, help="LM sequences per step")
    p.add_argument("--grpc-port", type=int, help="e+pd proxy gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, help="e+pd proxy HTTP port (default 8000)")
    p.add_argument("--plot", help="write latency vs request rate to this PNG")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
