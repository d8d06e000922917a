"""Parse a checkpoint's JSON files (Hugging Face layout) into frozen, typed configs.

Two families: Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`). Two layouts of config.json are read:

- transformers >= 5: the language model's keys under `text_config`, rope under
  `text_config.rope_parameters` (`rope_type`, `rope_theta`, `mrope_section`);
- the flat layout the released checkpoints ship: the language model's keys at the top level,
  `rope_theta` beside them and `rope_scaling: {"type": "mrope", "mrope_section": [...]}`.

Preprocessor settings come from processor_config.json (a nested `image_processor` /
`video_processor`), video_preprocessor_config.json or preprocessor_config.json, in the order
transformers reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from models.checkpoint import CheckpointError, parse_dtype, read_json

Family = Literal["qwen2_vl", "qwen2_5_vl"]

ARCHITECTURES: dict[str, Family] = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}

# CLIP statistics: the processors' defaults when a config leaves them out.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    # Split of the head_dim / 2 rotary frequencies over the (t, h, w) position axes.
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int  # the tower's width ("embed_dim" in Qwen2-VL configs)
    num_heads: int
    intermediate_size: int  # the block MLP's width
    hidden_act: str
    out_hidden_size: int  # the merger's output: the LM's hidden size
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    # Qwen2-VL: LayerNorm and a plain fc1 / fc2 MLP; Qwen2.5-VL: RMSNorm and a gated (SwiGLU) MLP.
    layer_norm: bool = False
    gated_mlp: bool = True
    # Qwen2.5-VL: window attention (windows of window_size pixels) everywhere except these
    # blocks; 0: full attention per frame in every block (Qwen2-VL).
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    # Qwen2.5-VL only: M-RoPE temporal positions per second of video.
    tokens_per_second: float | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class SpecialTokens:
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # generation_config.json's eos ids first, then config.json's.
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything config.json and generation_config.json say about one checkpoint."""

    family: Family
    architecture: str
    dtype: torch.dtype  # the dtype the weights were saved in
    text: TextConfig
    vision: VisionConfig
    tokens: SpecialTokens
    # EVS: the fraction of a video's tokens pruned (config.json `video_pruning_rate`; 0: off).
    video_pruning_rate: float = 0.0


@dataclass(frozen=True)
class ProcessorConfig:
    """Image or video preprocessing settings (one of each per checkpoint)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    # Video containers: frames sampled per second, and bounds on the sampled count.
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def with_overrides(self, overrides: dict[str, Any] | None) -> ProcessorConfig:
        """Per-item kwargs (min_pixels, max_pixels, size) on top of the checkpoint's settings."""
        if not overrides:
            return self
        return _processor_config(overrides, base=self, where="processor kwargs")


# The video processor's own defaults, used when its config omits `size`.
VIDEO_DEFAULTS = ProcessorConfig(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)


def load_arch_config(checkpoint_dir: str | Path) -> ModelArchConfig:
    """config.json (+ generation_config.json when present) of a Qwen2-VL / Qwen2.5-VL checkpoint."""
    root = Path(checkpoint_dir)
    path = root / "config.json"
    if not path.exists():
        raise CheckpointError(f"{root}: no config.json (is this a checkpoint directory?)")
    cfg = read_json(path)
    architecture = next((a for a in cfg.get("architectures") or [] if a in ARCHITECTURES), None)
    if architecture is None:  # no architectures list: go by model_type
        by_type = {family: arch for arch, family in ARCHITECTURES.items()}
        architecture = by_type.get(cfg.get("model_type"))
    if architecture is None:
        raise CheckpointError(
            f"{path}: architectures {cfg.get('architectures')} / model_type "
            f"{cfg.get('model_type')!r}: supported are {sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[architecture]
    # transformers 5 nests the LM's keys under text_config; flat checkpoints keep them on top.
    text = {**cfg, **(cfg.get("text_config") or {})}
    generation = {}
    if (root / "generation_config.json").exists():
        generation = read_json(root / "generation_config.json")
    return ModelArchConfig(
        family=family,
        architecture=architecture,
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype"), path),
        text=_text_config(cfg, text, path),
        vision=_vision_config(family, cfg.get("vision_config") or {}, path),
        tokens=_special_tokens(cfg, text, generation),
        video_pruning_rate=check_pruning_rate(cfg.get("video_pruning_rate") or 0.0, str(path)),
    )


def check_pruning_rate(q: Any, where: str) -> float:
    """A video pruning rate in [0, 1) (0: EVS off)."""
    if isinstance(q, bool) or not isinstance(q, int | float) or not (0 <= q < 1):
        raise CheckpointError(f"{where}: video_pruning_rate must be in [0, 1), got {q!r}")
    return float(q)


def load_processor_configs(
    checkpoint_dir: str | Path,
    image_defaults: ProcessorConfig | None = None,
    video_defaults: ProcessorConfig | None = None,
) -> tuple[ProcessorConfig, ProcessorConfig]:
    """(image, video) preprocessing settings of a checkpoint, over the family's defaults
    (Qwen2-VL's when None) for what its files leave out."""
    root = Path(checkpoint_dir)
    nested = (
        read_json(root / "processor_config.json")
        if (root / "processor_config.json").exists()
        else {}
    )
    image_raw = nested.get("image_processor")
    if image_raw is None and (root / "preprocessor_config.json").exists():
        image_raw = read_json(root / "preprocessor_config.json")
    video_raw = nested.get("video_processor")
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if video_raw is None and (root / name).exists():
            video_raw = read_json(root / name)
    image_base, video_base = image_defaults or ProcessorConfig(), video_defaults or VIDEO_DEFAULTS
    image = _processor_config(image_raw or {}, base=image_base, where=str(root))
    video = _processor_config(video_raw or {}, base=video_base, where=str(root))
    return image, video


def _rope(text: dict[str, Any], path: Path) -> tuple[float, tuple[int, int, int]]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported (only M-RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    # NOTE: the reference falls back to Qwen2-VL-7B's split when the config has none.
    section = tuple(params.get("mrope_section") or (16, 24, 24))
    if len(section) != 3:
        raise CheckpointError(f"{path}: mrope_section {list(section)} must have 3 entries")
    return float(theta), section  # type: ignore[return-value]


def _text_config(cfg: dict[str, Any], text: dict[str, Any], path: Path) -> TextConfig:
    try:
        theta, section = _rope(text, path)
        heads = int(text["num_attention_heads"])
        tie = cfg.get("tie_word_embeddings")
        if tie is None:
            tie = text.get("tie_word_embeddings", False)
        # NOTE: the reference also forwards a pre-v5 text_config.tie_word_embeddings = true.
        tie = bool(tie) or bool((cfg.get("text_config") or {}).get("tie_word_embeddings", False))
        out = TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            mrope_section=section,
            tie_word_embeddings=tie,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r} of the language model") from e
    if out.hidden_size % out.num_heads or out.num_heads % out.num_kv_heads:
        raise CheckpointError(
            f"{path}: hidden_size {out.hidden_size}, num_attention_heads {out.num_heads} and "
            f"num_key_value_heads {out.num_kv_heads} must divide evenly"
        )
    if sum(out.mrope_section) * 2 != out.head_dim:
        raise CheckpointError(
            f"{path}: mrope_section {list(out.mrope_section)} must sum to head_dim / 2 = "
            f"{out.head_dim // 2}"
        )
    if text.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window is not supported")
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {text['hidden_act']!r}: only silu is supported")
    return out


def _vision_config(family: Family, v: dict[str, Any], path: Path) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    common = dict(
        depth=int(v.get("depth", 32)),
        num_heads=int(v.get("num_heads", 16)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if family == "qwen2_vl":
        embed_dim = int(v.get("embed_dim", 1280))
        out = VisionConfig(
            hidden_size=embed_dim,
            intermediate_size=int(embed_dim * v.get("mlp_ratio", 4)),
            hidden_act=v.get("hidden_act", "quick_gelu"),
            out_hidden_size=int(v.get("hidden_size", 3584)),
            layer_norm=True,
            gated_mlp=False,
            **common,
        )
    else:
        out = VisionConfig(
            hidden_size=int(v.get("hidden_size", 3584)),
            intermediate_size=int(v.get("intermediate_size", 3420)),
            hidden_act=v.get("hidden_act", "silu"),
            out_hidden_size=int(v.get("out_hidden_size", 3584)),
            window_size=int(v.get("window_size", 112)),
            fullatt_block_indexes=tuple(
                int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))
            ),
            tokens_per_second=float(v.get("tokens_per_second", 4)),
            **common,
        )
    if out.hidden_size % out.num_heads or out.head_dim % 4:
        raise CheckpointError(
            f"{path}: vision hidden size {out.hidden_size} / {out.num_heads} heads must give a "
            "head_dim divisible by 4 (2-D rotary embedding)"
        )
    if out.hidden_act not in ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: vision hidden_act {out.hidden_act!r} is not supported")
    return out


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _special_tokens(
    cfg: dict[str, Any], text: dict[str, Any], generation: dict[str, Any]
) -> SpecialTokens:
    # NOTE: transformers' text_config carries the real family's bos / eos (151643 / 151645) when a
    # config leaves them unset, so generation_config.json and the top level come first.
    eos: list[int] = []
    for source in (generation.get("eos_token_id"), cfg.get("eos_token_id")):
        eos.extend(i for i in _ids(source) if i not in eos)
    if not eos:
        eos.extend(_ids(text.get("eos_token_id")))
    bos = generation.get("bos_token_id", cfg.get("bos_token_id", text.get("bos_token_id")))
    pad = generation.get("pad_token_id", cfg.get("pad_token_id", text.get("pad_token_id")))
    return SpecialTokens(
        image_token_id=int(cfg.get("image_token_id", 151655)),
        video_token_id=int(cfg.get("video_token_id", 151656)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
        eos_token_ids=tuple(eos),
        bos_token_id=bos,
        pad_token_id=pad,
    )


def _processor_config(raw: dict[str, Any], base: ProcessorConfig, where: str) -> ProcessorConfig:
    values = {k: getattr(base, k) for k in base.__dataclass_fields__}
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise CheckpointError(f"{where}: size must be an object, got {size!r}")
    # As the reference: `size` first, then min_pixels / max_pixels on top of it.
    for key, field_name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if size.get(key) is not None:
            values[field_name] = int(size[key])
    for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
        if raw.get(key) is not None:
            values[key] = int(raw[key])
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(key) is not None:
            values[key] = bool(raw[key])
    for key in ("image_mean", "image_std"):
        if raw.get(key) is not None:
            seq = raw[key] if isinstance(raw[key], list | tuple) else [raw[key]] * 3
            values[key] = tuple(float(x) for x in seq)
    for key in ("min_frames", "max_frames"):
        if raw.get(key) is not None:
            values[key] = int(raw[key])
    for key in ("rescale_factor", "fps"):
        if raw.get(key) is not None:
            values[key] = float(raw[key])
    if raw.get("resample") is not None:
        values["resample"] = int(raw["resample"])
    out = ProcessorConfig(**values)
    if not (math.isfinite(out.fps) and out.fps > 0):
        raise CheckpointError(f"{where}: fps must be a positive number, got {out.fps}")
    if not 1 <= out.min_frames <= out.max_frames:
        raise CheckpointError(
            f"{where}: need 1 <= min_frames <= max_frames, got {out.min_frames} / {out.max_frames}"
        )
    if not 0 < out.min_pixels <= out.max_pixels:
        raise CheckpointError(
            f"{where}: need 0 < min_pixels <= max_pixels, got {out.min_pixels} / {out.max_pixels}"
        )
    return out
