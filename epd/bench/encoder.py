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

Then, per side in `--mfu-sizes`, the tower's forward alone (no engine, no Redis, no copies: the
preprocessed pixels already on the device) over `--mfu-batch` square images of that side, best
of a few: images/s, and MFU, the FLOPs `vision_flops` counts over that time against the
device's dense matmul rate in the tower's dtype (epd/bench/lm.py's `matmul_peak`).

`--device` (auto: CUDA when there is one) runs the tower there; `--size 3b` / `7b` benchmarks a
random checkpoint of Qwen2.5-VL-3B's / -7B's shapes in bf16 (drawn on the GPU when it runs on
one), `small` (the default) the random small model.
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
import torch
from PIL import Image
from prometheus_client import CollectorRegistry
from torch import nn

from common.config import ClusterConfig, ConnectorConfig, EncoderConfig, ModelConfig
from common.device import resolve_device
from connector import AsyncECConnector
from connector.embedded import redis_or_embedded
from encoder_worker.encoder import EncodeItem, MMEncoder
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.tower import Tower, load_tower
from epd.bench import add_checkpoint_arguments, bench_checkpoint, video
from epd.bench.lm import best_seconds, matmul_peak
from models import MediaInput, ProcessedMedia

MFU_REPEATS = 5


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


def vision_flops(tower: nn.Module, grid: tuple[int, int, int]) -> float:
    """FLOPs of one item's forward through a vision tower (models/qwen2_vl/vision.py), its
    (t, h, w) patch grid given: 2 per weight of every linear layer per token it runs on -- the
    patch embedding's Conv3d (its kernel is the whole patch: a linear over the flattened patch)
    and the blocks' layers once per patch, the merger's once per merged token (spatial_merge_size^2
    patches) -- and attention's two products, 2 x 2 x len^2 x hidden per block and segment: the
    frame (h x w patches) in full-attention blocks, each window in Qwen2.5-VL's windowed ones.
    Norms, activations, the rotary embedding, softmax and biases are not counted."""
    c = tower.config
    t, h, w = grid
    m = c.spatial_merge_size
    patches = t * h * w
    flops = 0.0
    for name, module in tower.named_modules():
        if isinstance(module, nn.Conv3d):
            # NOTE: counted as the linear it runs as; only right for a kernel equal to its stride.
            assert module.kernel_size == module.stride, (name, module.kernel_size, module.stride)
        if isinstance(module, (nn.Linear, nn.Conv3d)):
            merged = "merger" in name.split(".")[0]  # merger, Qwen3-VL's deepstack_merger_list
            flops += 2.0 * module.weight.numel() * (patches // (m * m) if merged else patches)
    frame = (h * w) ** 2
    window_side = getattr(c, "window_size", 0) // m // c.patch_size  # in merged tokens
    windowed = frame
    if window_side:
        # A frame's merged grid is cut into window_side-square windows, smaller at the far
        # edges; a window of r x c merged tokens attends over r * c * m^2 patches.
        rows = sum(min(window_side, h // m - i) ** 2 for i in range(0, h // m, window_side))
        cols = sum(min(window_side, w // m - j) ** 2 for j in range(0, w // m, window_side))
        windowed = rows * cols * m**4
    full = set(getattr(c, "fullatt_block_indexes", ()))
    squares = sum(frame if i in full else windowed for i in range(len(tower.blocks)))
    return flops + 4.0 * c.hidden_size * t * squares


@torch.inference_mode()
def forward_seconds(module: nn.Module, batch: list[ProcessedMedia], device: torch.device) -> float:
    """The best of MFU_REPEATS forwards of `module` over `batch`, its pixels already on
    `device` (one untimed forward first: kernels chosen, memory allocated)."""
    pixels = torch.cat([p.pixel_values for p in batch]).to(device)  # [patches, C * T * P * P]
    grids = [p.grid.grid_thw for p in batch]
    module.embed_multimodal(pixels, grids)
    return best_seconds(lambda: module.embed_multimodal(pixels, grids), MFU_REPEATS)


def measure_mfu(tower: Tower, sides: list[int], batch: int) -> dict:
    """Images/s and MFU of the tower's forward alone, per square image side."""
    module = getattr(tower.encoder, "tower", None)
    if not isinstance(module, nn.Module) or not hasattr(module, "embed_multimodal"):
        raise SystemExit("--mfu-sizes: this model's encoder is not a vision tower; pass ''")
    peak = matmul_peak(tower.device.type, tower.dtype)
    rows = []
    for side in sides:
        # Preprocessing may resize (the checkpoint's pixel limits): the grids say what ran.
        prepared = [tower.prepare(MediaInput("image", image=b)) for b in noise_images(batch, side)]
        seconds = forward_seconds(module, prepared, tower.device)
        flops = sum(vision_flops(module, p.grid.grid_thw) for p in prepared)
        rows.append(
            {
                "side": side,
                "grid_thw": list(prepared[0].grid.grid_thw),
                "batch": batch,
                "seconds": round(seconds, 6),
                "images_per_second": round(batch / seconds, 3),
                "gflops_per_image": round(flops / batch / 1e9, 3),
                "tflops": round(flops / seconds / 1e12, 4),
                "mfu": round(flops / seconds / peak, 4),
            }
        )
        r = rows[-1]
        print(
            f"mfu {side}px  grid {r['grid_thw']}  batch {batch}  "
            f"{r['images_per_second']:8.2f} images/s  {r['tflops']:8.3f} TFLOP/s  "
            f"MFU {100 * r['mfu']:5.1f}% of {peak / 1e12:.2f} TFLOP/s",
            flush=True,
        )
    return {"matmul_peak_tflops": round(peak / 1e12, 3), "sizes": rows}


async def bench(args: argparse.Namespace, checkpoint: Path, model: str, url: str) -> dict:
    config = ClusterConfig(
        model=ModelConfig(path=str(checkpoint)),
        connector=ConnectorConfig(url=url),
        # The bench is the device's only process: the whole of it, not an encoder's share.
        encoder=EncoderConfig(
            device=args.device, max_batch_items=args.max_batch_items, gpu_memory_utilization=0.9
        ),
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
    if args.mfu_sizes is None:
        args.mfu_sizes = "448,896" if tower.device.type == "cuda" else "224"
    sizes = [int(v) for v in args.mfu_sizes.split(",") if v.strip()]
    mfu = measure_mfu(tower, sizes, args.mfu_batch) if sizes else None
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
        "mfu": mfu,
    }


def run(args: argparse.Namespace) -> int:
    # NOTE: --device defaults by mode: video mode's has always been cpu, the tower's auto.
    args.device = args.device or ("cpu" if args.video else "auto")
    try:
        device = resolve_device(args.device, "--device")
    except RuntimeError:
        raise SystemExit("--device cuda: torch finds no CUDA device here") from None
    if args.video:
        if args.size:
            args.model = str(bench_checkpoint(args, device.type)[0])
        args.device = device.type
        return video.run(args)
    checkpoint, model = bench_checkpoint(args, device.type)
    with redis_or_embedded(args.redis_url) as (url, server):
        summary = asyncio.run(bench(args, checkpoint, model, url))
    summary["server"] = server
    print(json.dumps(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "encoder", help="encoder items/s: cross-request batching vs one item at a time; tower MFU"
    )
    add_checkpoint_arguments(p)
    p.add_argument("--redis-url", help="publish into this Redis (default: an embedded one)")
    p.add_argument("--items", type=int, default=48, help="images per side and round (48)")
    p.add_argument("--image-size", type=int, default=224, help="square image side in px (224)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent callers (8)")
    p.add_argument(
        "--max-batch-items", type=int, default=32, help="the batched side's item cap (32)"
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    p.add_argument(
        "--mfu-sizes",
        help="square image sides (px) to time the tower's forward alone at, comma-separated; "
        "'' for none (default: 448,896 on CUDA, 224 on a CPU)",
    )
    p.add_argument("--mfu-batch", type=int, default=8, help="images per timed forward (8)")
    video.add_arguments(p)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help="where the tower runs (auto: CUDA when there is one; video mode: cpu)",
    )
    p.set_defaults(func=run)
