"""Which family serves a checkpoint: config.json's `architectures` -> the family's class.

ARCHITECTURES is the one list of what we serve: each entry's short name (`epd make-model
--arch`, config.json's `model_type`), its Hugging Face class (config.json's `architectures`)
and its family. Adding a family is its own module under models/ plus one line here. Family
modules are imported only when a checkpoint of theirs is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from models.checkpoint import CheckpointError, read_json
from models.family import FamilyOptions, ModelFamily


@dataclass(frozen=True)
class Architecture:
    """One architecture we serve."""

    name: str  # short name: `epd make-model --arch`, config.json's model_type
    hf_class: str  # config.json's `architectures` entry
    family: str  # "module:FamilyClass", imported when a checkpoint of it is loaded


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("qwen2_vl", "Qwen2VLForConditionalGeneration", "models.qwen2_vl:Qwen2VLFamily"),
    Architecture(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "models.qwen2_vl:Qwen2VLFamily"
    ),
    Architecture("qwen3_vl", "Qwen3VLForConditionalGeneration", "models.qwen3_vl:Qwen3VLFamily"),
    Architecture(
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "models.qwen3_vl:Qwen3VLFamily"
    ),
    Architecture(
        "voxtral_realtime",
        "VoxtralRealtimeForConditionalGeneration",
        "models.voxtral_realtime:VoxtralRealtimeFamily",
    ),
)
ARCH_NAMES: tuple[str, ...] = tuple(a.name for a in ARCHITECTURES)
# architecture (config.json) -> "module:FamilyClass"
FAMILIES: dict[str, str] = {a.hf_class: a.family for a in ARCHITECTURES}


def arch_by_name(name: str) -> Architecture:
    """The entry of a short name ('qwen2_vl'); ValueError naming the known ones otherwise."""
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise ValueError(f"arch must be one of {sorted(ARCH_NAMES)}, got {name!r}")


def family_class(architecture: str) -> type[ModelFamily]:
    module, _, name = FAMILIES[architecture].partition(":")
    return getattr(importlib.import_module(module), name)


def load_family(checkpoint_dir: str | Path, options: FamilyOptions | None = None) -> ModelFamily:
    """The family object of a checkpoint directory (reads its JSON files, no weights)."""
    root = Path(checkpoint_dir)
    path = root / "config.json"
    if not path.exists():
        raise CheckpointError(f"{root}: no config.json (is this a checkpoint directory?)")
    cfg = read_json(path)
    known = [a for a in cfg.get("architectures") or [] if a in FAMILIES]
    if not known and cfg.get("model_type"):  # no architectures list: go by model_type
        known = [a for a in FAMILIES if _squash(a).startswith(_squash(cfg["model_type"]) + "for")]
    if not known:
        raise CheckpointError(
            f"{path}: architectures {cfg.get('architectures')} / model_type "
            f"{cfg.get('model_type')!r}: supported are {sorted(FAMILIES)}"
        )
    return family_class(known[0])(root, options)


def _squash(name: str) -> str:
    """'Qwen2_5_VLForConditionalGeneration' and 'qwen2_5_vl' compare as 'qwen25vl...'."""
    return str(name).replace("_", "").lower()
