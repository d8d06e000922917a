"""The model a cluster serves, resolved the same way by every role.

All roles must agree on the embedding cache's keys, so the dtype is decided without looking at
the local device: `model.dtype: auto` is the dtype the checkpoint was saved in (what Hugging Face
calls "auto"). A real Qwen2.5-VL checkpoint is bf16, so encoders publish bf16 whether they run
on a GPU or a CPU, and every LM worker looks the embeddings up under the same fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from epd.config import ClusterConfig, cache_dir


@dataclass(frozen=True)
class ServedModel:
    path: Path
    name: str
    dtype: torch.dtype
    fingerprint: str  # the EC connector's key component for this model's embeddings


def resolve_model(config: ClusterConfig) -> ServedModel:
    """The checkpoint directory (the built-in model, written on first use, when none is set),
    its compute dtype and its embedding fingerprint."""
    from models import ensure_builtin_model, load_arch_config, model_fingerprint

    path = Path(config.model.path) if config.model.path else ensure_builtin_model(cache_dir())
    arch = load_arch_config(path)
    dtype = arch.dtype if config.model.dtype == "auto" else getattr(torch, config.model.dtype)
    return ServedModel(path, config.model.served_name, dtype, model_fingerprint(path, dtype))
