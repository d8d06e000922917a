"""Safetensors checkpoints: find, read and cast only the tensors a role needs.

A checkpoint holds one `model.safetensors` or shards listed by `model.safetensors.index.json`.
Tensor names come in two spellings, both mapped to one local name per module:

| role   | released checkpoints | transformers >= 5 modules | local name       |
|--------|----------------------|---------------------------|------------------|
| vision | `visual.X`           | `model.visual.X`          | `X`              |
| lm     | `model.X`            | `model.language_model.X`  | `X`              |
| lm     | `lm_head.weight`     | `lm_head.weight`          | `lm_head.weight` |
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from models.config import CheckpointError, load_arch_config

Role = Literal["vision", "lm"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Bump when our preprocessing or tower numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1
# Bytes read from the start of every vision tensor for the fingerprint (see model_fingerprint).
_FINGERPRINT_SAMPLE = 4096


def local_name(name: str, role: Role) -> str | None:
    """The module-local name of checkpoint tensor `name`, None if it is not `role`'s."""
    if role == "vision":
        for prefix in ("visual.", "model.visual."):
            if name.startswith(prefix):
                return name[len(prefix) :]
        return None
    if name == "lm_head.weight":
        return name
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix) and not name.startswith("model.visual."):
            return name[len(prefix) :]
    return None


def weight_map(checkpoint_dir: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to the directory)."""
    root = Path(checkpoint_dir)
    if (root / INDEX_FILE).exists():
        index = json.loads((root / INDEX_FILE).read_text())
        mapping = index.get("weight_map")
        if not isinstance(mapping, dict) or not mapping:
            raise CheckpointError(f"{root / INDEX_FILE}: no weight_map")
        for file in sorted(set(mapping.values())):
            if not (root / file).exists():
                raise CheckpointError(f"{root / INDEX_FILE}: lists {file}, which is missing")
        return dict(mapping)
    if (root / SINGLE_FILE).exists():
        return {name: SINGLE_FILE for name in read_header(root / SINGLE_FILE)[0]}
    raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE}")


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """(tensor name -> {dtype, shape, data_offsets}, start of the data region) of one file."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def load_tensors(
    checkpoint_dir: str | Path,
    role: Role,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The role's tensors, under their local names, cast to `dtype` (None: as stored).

    Only the files that hold the role's tensors are opened, and only those tensors are read.
    """
    root = Path(checkpoint_dir)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, file in weight_map(root).items():
        local = local_name(name, role)
        if local is not None:
            by_file.setdefault(file, []).append((name, local))
    if not by_file:
        raise CheckpointError(f"{root}: no {role} tensors in the checkpoint")
    out: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(root / file), framework="pt", device="cpu") as f:
            for name, local in names:
                if local in out:
                    raise CheckpointError(f"{root}: tensor {local} appears twice (as {name})")
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[local] = tensor.to(device)
    return out


def model_fingerprint(checkpoint_dir: str | Path, tower_dtype: torch.dtype | str) -> str:
    """A short, stable hex id of everything that decides what the vision tower outputs.

    It covers the vision config, the image and video preprocessor
    settings, the tower dtype, our embedding code's version, and the identity of the vision
    weights: each file's size and header (names, dtypes, shapes, offsets) plus the first 4 KiB
    of every vision tensor. That reads a few MiB at most, never whole weight files, yet any
    retrained or fine-tuned tower changes it. Two hosts with copies of one checkpoint agree.
    """
    from models.config import load_processor_configs

    root = Path(checkpoint_dir)
    arch = load_arch_config(root)
    image_cfg, video_cfg = load_processor_configs(root)
    h = hashlib.sha256()

    def add(label: str, value: object) -> None:
        h.update(label.encode() + b"\0" + json.dumps(value, sort_keys=True, default=str).encode())

    add("code", EMBEDDING_CODE_VERSION)
    add("dtype", str(tower_dtype).removeprefix("torch."))
    add("vision", arch.vision.__dict__)
    add("image", image_cfg.__dict__)
    add("video", video_cfg.__dict__)
    files = sorted({f for n, f in weight_map(root).items() if local_name(n, "vision") is not None})
    for file in files:
        path = root / file
        header, data_start = read_header(path)
        add("file", [file, path.stat().st_size, header])
        with path.open("rb") as f:
            for name in sorted(header):
                if local_name(name, "vision") is None:
                    continue
                begin, end = header[name]["data_offsets"]
                f.seek(data_start + begin)
                h.update(f.read(min(end - begin, _FINGERPRINT_SAMPLE)))
    return h.hexdigest()[:16]
