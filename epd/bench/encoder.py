"""`epd bench encoder`: items per second with cross-request batching next to one at a time
(`--video`: tokens per video and time to first token with EVS vs off, epd/bench/video.py).

Both sides run the same engine (`MMEncoder.execute_mm_encoder`, preprocessing, tower, puts into
the same Redis) over the same loaded tower and the same images; only `encoder.max_batch_items`
differs (the configured cap vs 1). `--concurrency` callers each send single-item requests back
to back, so every batch bigger than one item is cross-request batching. The two sides alternate
round by round so drift hits both alike; medians are reported. Prints one line per round and,
last, one JSON object.

NOTE: on CPU cores a transformer tower is compute-bound already at one item, so batching gains
little there (bigger matrix products, fewer per-forward overheads); on a GPU one item leaves most
of the device idle, and that is where batching pays. The JSON says which device ran.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image
from prometheus_client import CollectorRegistry

from common.config import ClusterConfig, ConnectorConfig, EncoderConfig, ModelConfig
from common.served_model import ensure_bench_model
from connector import AsyncECConnector
from connector.embedded import redis_or_embedded
from encoder_worker.encoder import EncodeItem, MMEncoder
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.tower import Tower, load_tower
from epd.bench import video
from models import MediaInput


def noise_images(count: int, side: int) -> list[bytes]:
    """Distinct PNGs of random pixels (nothing for a codec or the tower to shortcut)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


async def run_side(
    tower: Tower,
    url: str,
    fingerprint: str,
    settings: EncoderConfig,
    images: list[bytes],
    concurrency: int,
    tag: str,
) -> dict:
    """Every image once, as single-item requests from `concurrency` callers."""
    registry = CollectorRegistry()
    connector = AsyncECConnector(url, fingerprint, registry=None)
    engine = MMEncoder(tower, connector, settings, EncoderMetrics(registry))
    engine.start()
    items = [EncodeItem(f"{tag}-{i}", MediaInput("image", image=b)) for i, b in enumerate(images)]
    todo = iter(items)
    failed = []

    async def caller() -> None:
        for item in todo:
            (result,) = await engine.execute_mm_encoder([item])
            if result.outcome != "stored":
                failed.append((result.mm_hash, result.outcome, result.error))

    try:
        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        await engine.close()
        await connector.delete([i.mm_hash for i in items])
        await connector.close()
    if failed:
        raise RuntimeError(f"items were not stored: {failed[:3]}")
    value = registry.get_sample_value
    batches = value("epd_encoder_batch_items_count")
    return {
        "items_per_second": len(items) / elapsed,
        "mean_batch_items": value("epd_encoder_batch_items_sum") / batches,
        "tower_seconds_per_item": value("epd_encoder_tower_seconds_sum") / len(items),
    }


async def bench(args: argparse.Namespace, checkpoint: Path, model: str, url: str) -> dict:
    config = ClusterConfig(
        model=ModelConfig(path=str(checkpoint)),
        connector=ConnectorConfig(url=url),
        encoder=EncoderConfig(max_batch_items=args.max_batch_items),
    )
    tower, served = await asyncio.to_thread(load_tower, config)
    images = noise_images(args.items, args.image_size)
    sides = {
        "batched": config.encoder,
        "one_at_a_time": EncoderConfig(max_batch_items=1),
    }
    # Untimed: a few items through both sides (allocator, thread pools, first shapes).
    for name, settings in sides.items():
        await run_side(tower, url, served.fingerprint, settings, images[:4], 4, f"warm-{name}")
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            tag = f"bench-{r}-{name}"
            res = await run_side(
                tower, url, served.fingerprint, sides[name], images, args.concurrency, tag
            )
            runs[name].append(res)
            print(
                f"round {r}  {name:<13} {res['items_per_second']:6.2f} items/s  "
                f"mean batch {res['mean_batch_items']:5.2f} items  "
                f"tower {1000 * res['tower_seconds_per_item']:6.1f} ms/item",
                flush=True,
            )
    med = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    grid = tower.grid(MediaInput("image", image=images[0]))
    return {
        "bench": "encoder",
        "device": str(tower.device),
        "dtype": str(tower.dtype).removeprefix("torch."),
        "model": model,
        "items": args.items,
        "image": f"{args.image_size}x{args.image_size} ({grid.num_tokens} embeddings)",
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "batched_items_per_second": round(med["batched"]["items_per_second"], 3),
        "one_at_a_time_items_per_second": round(med["one_at_a_time"]["items_per_second"], 3),
        "batched_vs_one_at_a_time": round(
            med["batched"]["items_per_second"] / med["one_at_a_time"]["items_per_second"], 3
        ),
        "mean_batch_items": round(med["batched"]["mean_batch_items"], 2),
        "results": med,
    }


def run(args: argparse.Namespace) -> int:
    if args.video:
        return video.run(args)
    if args.model:
        checkpoint, model = Path(args.model), args.model
    else:
        print("using the random small model (written on first use)", flush=True)
        checkpoint, model = ensure_bench_model(), "random small (qwen2_5_vl)"
    with redis_or_embedded(args.redis_url) as (url, server):
        summary = asyncio.run(bench(args, checkpoint, model, url))
    summary["server"] = server
    print(json.dumps(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "encoder", help="encoder items/s: cross-request batching vs one item at a time"
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in small model)")
    p.add_argument("--redis-url", help="publish into this Redis (default: an embedded one)")
    p.add_argument("--items", type=int, default=48, help="images per side and round (48)")
    p.add_argument("--image-size", type=int, default=224, help="square image side in px (224)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent callers (8)")
    p.add_argument(
        "--max-batch-items", type=int, default=32, help="the batched side's item cap (32)"
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    video.add_arguments(p)
    p.set_defaults(func=run)
