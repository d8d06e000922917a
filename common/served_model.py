"""The model a cluster serves, resolved the same way by every role.

All roles must agree on the embedding cache's keys, so the dtype is decided without looking at
the local device: `model.dtype: auto` is the dtype the checkpoint was saved in (what Hugging Face
calls "auto"). A real Qwen2.5-VL checkpoint is bf16, so encoders publish bf16 whether they run
on a GPU or a CPU, and every LM worker looks the embeddings up under the same fingerprint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import ClusterConfig, cache_dir
from models import FamilyOptions, ModelFamily, load_family
from models.demo import BUILTIN_DIR

# The benchmarks' model when none is given: a random `small` Qwen2.5-VL checkpoint (~100M LM
# parameters, the size the speed figures are about), written once under the cache directory.
BENCH_ARCH = "qwen2_5_vl"
BENCH_SIZE = "small"
BENCH_SEED = 0
BENCH_SIZES = ("small", "3b", "7b")
PROGRESS_SECONDS = 30.0


@dataclass(frozen=True)
class ServedModel:
    path: Path
    name: str
    dtype: torch.dtype
    fingerprint: str  # the EC connector's key component for this model's embeddings
    family: ModelFamily


def resolve_model(config: ClusterConfig) -> ServedModel:
    """The checkpoint directory (the built-in model when none is set), its family, its compute
    dtype and its embedding fingerprint."""
    path = Path(config.model.path) if config.model.path else builtin_model()
    e = config.encoder
    options = FamilyOptions(
        video_pruning_rate=e.video_pruning_rate,
        max_video_frames=e.max_video_frames,
        max_video_seconds=e.max_video_seconds,
        max_audio_seconds=e.max_audio_seconds,
    )
    family = load_family(path, options)
    dtype = family.dtype if config.model.dtype == "auto" else getattr(torch, config.model.dtype)
    return ServedModel(path, config.model.served_name, dtype, family.fingerprint(dtype), family)


def builtin_model() -> Path:
    """The built-in model: a tiny Qwen2.5-VL trained on the scene world (models/demo/), shipped
    with the package, so `epd up` answers questions about pictures of shapes out of the box."""
    if not (BUILTIN_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the built-in model is missing from {BUILTIN_DIR} (an install without package "
            "data?); reinstall the package, rebuild it with `epd train-demo`, or give "
            "model.path / --model"
        )
    return BUILTIN_DIR


def bench_model_dir(root: str | Path | None = None, size: str = BENCH_SIZE) -> Path:
    """Where the benchmarks' random model of `size` lives under the cache directory (it may not
    exist yet)."""
    from models.testing.make import FORMAT_VERSION

    name = f"{BENCH_ARCH}-{size}-seed{BENCH_SEED}-v{FORMAT_VERSION}"
    return Path(root or cache_dir()) / "models" / name


def ensure_bench_model(
    root: str | Path | None = None, size: str = BENCH_SIZE, device: str = "cpu"
) -> Path:
    """The benchmarks' random model of `size` (small, or Qwen2.5-VL-3b / 7b's shapes), written
    first if missing; `device` draws its weights (cuda: a 7B model's in seconds).

    Written into a temporary sibling directory and renamed into place, so a reader never sees
    a half-written checkpoint and processes racing to write it do not corrupt it (the first
    rename wins; the others drop their copy).
    """
    # NOTE: imported here, not at the top: role servers given a checkpoint never load the
    # random-checkpoint writer.
    from models.testing.make import make_checkpoint

    final = bench_model_dir(root, size)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    print(f"writing the random {size} model to {final} (first use)", flush=True)
    started = time.monotonic()
    done = threading.Event()

    def progress() -> None:  # a 7b model is 16 GB: minutes on a CPU
        while not done.wait(PROGRESS_SECONDS):
            written = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
            elapsed = time.monotonic() - started
            print(f"  {written / 1e9:.1f} GB written in {elapsed:.0f} s", flush=True)

    reporter = threading.Thread(target=progress, daemon=True)
    reporter.start()
    try:
        make_checkpoint(tmp, BENCH_ARCH, size, BENCH_SEED, device=device)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished first; its copy is identical.
    finally:
        done.set()
        reporter.join()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  written in {time.monotonic() - started:.0f} s", flush=True)
    return final
