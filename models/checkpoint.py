"""Checkpoints in the Hugging Face layout, for every family: JSON files, and safetensors read
tensor by tensor so that each role loads only its own part.

A checkpoint holds one `model.safetensors` or shards listed by `model.safetensors.index.json`.
A family says which tensors belong to a module with a `Selector`: checkpoint name -> the
module's local name, or None (e.g. Qwen2-VL's tower takes `visual.X` and `model.visual.X` as
`X`). Nothing here knows a family.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.parallel import Slice, read_slice

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Checkpoint tensor name -> the module's local name, or None when it is not the module's.
Selector = Callable[[str], str | None]

# Bytes read from the start of every encoder tensor for a fingerprint (weights_fingerprint).
_FINGERPRINT_SAMPLE = 4096


class CheckpointError(ValueError):
    """A checkpoint directory we cannot use; the message names the file and the key."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def parse_dtype(value: Any, path: Path) -> torch.dtype:
    """config.json's `dtype` / `torch_dtype` (float32 when absent)."""
    if value is None:
        return torch.float32
    if str(value).removeprefix("torch.") not in DTYPES:
        raise CheckpointError(f"{path}: dtype {value!r}: supported are {sorted(DTYPES)}")
    return DTYPES[str(value).removeprefix("torch.")]


def strip_prefixes(*prefixes: str, exclude: tuple[str, ...] = ()) -> Selector:
    """A Selector taking names under any of `prefixes` (tried in order, the prefix removed),
    except names under `exclude`."""

    def select(name: str) -> str | None:
        if name.startswith(exclude):
            return None
        for prefix in prefixes:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return None

    return select


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
    select: Selector,
    what: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    slices: Mapping[str, Slice] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors `select` takes, under their local names, cast to `dtype` (None: as stored).
    `what` names the module in errors. `slices` (tensor parallelism, models/parallel.py): of
    the tensors it names, only that slice is read.

    Only the files that hold those tensors are opened, and only those tensors are read.
    """
    root = Path(checkpoint_dir)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, file in weight_map(root).items():
        local = select(name)
        if local is not None:
            by_file.setdefault(file, []).append((name, local))
    if not by_file:
        raise CheckpointError(f"{root}: no {what} tensors in the checkpoint")
    out: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(root / file), framework="pt", device="cpu") as f:
            for name, local in names:
                if local in out:
                    raise CheckpointError(f"{root}: tensor {local} appears twice (as {name})")
                if slices and local in slices:
                    shape = f.get_slice(name).get_shape()
                    tensor = read_slice(f, name, shape, slices[local])
                else:
                    tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[local] = tensor.to(device)
    return out


def assign_module_weights(
    module: torch.nn.Module,
    checkpoint_dir: str | Path,
    select: Selector,
    what: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> None:
    """Take the tensors `select` takes as `module`'s parameters (built on the meta device),
    whole: anything the module lacks or the checkpoint leaves over is a CheckpointError
    naming the first few (a deepstack merger a config lists and the files lack, say)."""
    tensors = load_tensors(checkpoint_dir, select, what, dtype, device)
    missing, unexpected = module.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(
            f"{what} tensors do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def assign_lm_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], tied: bool) -> None:
    """Take a language model's checkpoint tensors (local names) as its parameters, whole: a
    tied head is the embedding matrix (a saved copy is dropped); anything missing or left over
    is a CheckpointError. The model has `embed_tokens` and `lm_head`."""
    tensors = dict(tensors)
    if tied:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise CheckpointError("untied checkpoint without lm_head.weight")
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if tied:
        missing = [m for m in missing if m != "lm_head.weight"]
        model.lm_head.weight = model.embed_tokens.weight
    if missing or unexpected:
        raise CheckpointError(
            f"LM tensors do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def weights_fingerprint(
    checkpoint_dir: str | Path, select: Selector, settings: dict[str, Any]
) -> str:
    """A short, stable hex id of what decides an encoder's output: `settings` (configs, dtype,
    code version: whatever the family says matters) and the identity of the tensors `select`
    takes: each file's size and header (names, dtypes, shapes, offsets) plus the first 4 KiB of
    every selected tensor. That reads a few MiB at most, never whole weight files, yet any
    retrained or fine-tuned encoder changes it. Two hosts with copies of one checkpoint agree.
    """
    root = Path(checkpoint_dir)
    h = hashlib.sha256()

    def add(label: str, value: object) -> None:
        h.update(label.encode() + b"\0" + json.dumps(value, sort_keys=True, default=str).encode())

    for key in sorted(settings):
        add(key, settings[key])
    files = sorted({f for n, f in weight_map(root).items() if select(n) is not None})
    for file in files:
        path = root / file
        header, data_start = read_header(path)
        add("file", [file, path.stat().st_size, header])
        with path.open("rb") as f:
            for name in sorted(header):
                if select(name) is None:
                    continue
                begin, end = header[name]["data_offsets"]
                f.seek(data_start + begin)
                h.update(f.read(min(end - begin, _FINGERPRINT_SAMPLE)))
    return h.hexdigest()[:16]
