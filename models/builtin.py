"""The built-in model `epd up` serves when no checkpoint is given: a random `small` Qwen2.5-VL
checkpoint, written once under the cache directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from models.make import FORMAT_VERSION, make_checkpoint

BUILTIN_ARCH = "qwen2_5_vl"
BUILTIN_SIZE = "small"
BUILTIN_SEED = 0


def builtin_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the built-in model lives (it may not exist yet)."""
    if cache_dir is None:
        from epd.config import cache_dir as default_cache_dir

        cache_dir = default_cache_dir()
    name = f"{BUILTIN_ARCH}-{BUILTIN_SIZE}-seed{BUILTIN_SEED}-v{FORMAT_VERSION}"
    return Path(cache_dir) / "models" / name


def ensure_builtin_model(cache_dir: str | Path | None = None) -> Path:
    """The built-in model's directory, written first if missing.

    Written into a temporary sibling directory and renamed into place, so a reader never sees
    a half-written checkpoint and processes racing to write it do not corrupt it (the first
    rename wins; the others drop their copy).
    """
    final = builtin_model_dir(cache_dir)
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
