"""`epd bench ...`: each benchmark prints its figures against a baseline run beside it."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.served_model import BENCH_ARCH, BENCH_SIZE, BENCH_SIZES, ensure_bench_model


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """--model, or --size of the random benchmark checkpoint."""
    p.add_argument("--model", help="checkpoint directory (default: the random small model)")
    p.add_argument(
        "--size",
        choices=BENCH_SIZES,
        help="the random benchmark checkpoint's shape, not with --model (default small; 3b / "
        "7b: Qwen2.5-VL-3B's / -7B's in bf16, written on first use)",
    )


def bench_checkpoint(args: argparse.Namespace, device: str) -> tuple[Path, str]:
    """--model, or the random checkpoint of --size (its weights drawn on `device`, cuda or
    cpu: a 7b one in seconds on a GPU), and what the figures call it."""
    if args.model and args.size:
        raise SystemExit("--size picks a random benchmark checkpoint, --model another: not both")
    if args.model:
        return Path(args.model), args.model
    size = args.size or BENCH_SIZE
    path = ensure_bench_model(size=size, device="cuda" if device == "cuda" else "cpu")
    print(f"using the random {size} model ({path})", flush=True)
    return path, f"random {size} ({BENCH_ARCH})"
