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
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import ClusterConfig, cache_dir
from models import FamilyOptions, ModelFamily, load_family

# The built-in model `epd up` serves when no checkpoint is given: a random `small` Qwen2.5-VL
# checkpoint, written once under the cache directory.
BUILTIN_ARCH = "qwen2_5_vl"
BUILTIN_SIZE = "small"
BUILTIN_SEED = 0


@dataclass(frozen=True)
class ServedModel:
    path: Path
    name: str
    dtype: torch.dtype
    fingerprint: str  # the EC connector's key component for this model's embeddings
    family: ModelFamily


def resolve_model(config: ClusterConfig) -> ServedModel:
    """The checkpoint directory (the built-in model, written on first use, when none is set),
    its family, its compute dtype and its embedding fingerprint."""
    path = Path(config.model.path) if config.model.path else ensure_builtin_model()
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


def builtin_model_dir(root: str | Path | None = None) -> Path:
    """Where the built-in model lives under the cache directory (it may not exist yet)."""
    from models.testing.make import FORMAT_VERSION

    name = f"{BUILTIN_ARCH}-{BUILTIN_SIZE}-seed{BUILTIN_SEED}-v{FORMAT_VERSION}"
    return Path(root or cache_dir()) / "models" / name


def ensure_builtin_model(root: str | Path | None = None) -> Path:
    """The built-in model's directory, written first if missing.

    Written into a temporary sibling directory and renamed into place, so a reader never sees
    a half-written checkpoint and processes racing to write it do not corrupt it (the first
    rename wins; the others drop their copy).
    """
    # NOTE: imported here, not at the top: role servers given a checkpoint never load the
    # random-checkpoint writer.
    from models.testing.make import make_checkpoint

    final = builtin_model_dir(root)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_checkpoint(tmp, BUILTIN_ARCH, BUILTIN_SIZE, BUILTIN_SEED)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished first; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
