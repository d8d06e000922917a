"""Parse a Qwen3-VL checkpoint's JSON files (transformers >= 5 layout) into frozen configs.

Two architectures: `Qwen3VLForConditionalGeneration` (dense) and
`Qwen3VLMoeForConditionalGeneration` (its MoE variant). The language model's keys sit under
`text_config`, its rope under `text_config.rope_parameters` (`rope_type`, `rope_theta`,
`mrope_section`, `mrope_interleaved`); the tower's under `vision_config`, with the learned
position grid (`num_position_embeddings`) and the deepstack layers
(`deepstack_visual_indexes`). Preprocessing settings are read as for Qwen2-VL
(models/qwen2_vl/config.py's `load_processor_configs`), and so are the special tokens.

Whatever this code cannot serve as the checkpoint says is refused here, at start-up, with the
field named: never served wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import CheckpointError, parse_dtype, read_json
from models.qwen2_vl.config import SpecialTokens, _special_tokens, check_pruning_rate

ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
MODEL_TYPES = {"qwen3_vl": ARCHITECTURES[0], "qwen3_vl_moe": ARCHITECTURES[1]}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of Qwen3-VL-MoE: `num_experts` SwiGLU experts, the router's top
    `top_k` per token, weights renormalised over those when `norm_topk_prob`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's width
    norm_topk_prob: bool
    decoder_sparse_step: int  # every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...]  # ... except these, which keep a dense MLP

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 (not hidden_size / num_heads)
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False
    moe: MoEConfig | None = None  # None: every layer dense


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    out_hidden_size: int  # the mergers' output: the LM's hidden size
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int  # the learned position grid, side x side
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output a deepstack merger takes
    rope_theta: float = 10000.0
    # A video's temporal positions step by frame index (not Qwen2.5-VL's seconds): None.
    tokens_per_second: None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_levels(self) -> int:
        """Rows per placeholder the tower publishes: the main embedding, then one per
        deepstack level."""
        return 1 + len(self.deepstack_visual_indexes)


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    dtype: torch.dtype
    text: TextConfig
    vision: VisionConfig
    tokens: SpecialTokens
    video_pruning_rate: float = 0.0


def load_arch_config(checkpoint_dir: str | Path) -> ModelArchConfig:
    root = Path(checkpoint_dir)
    path = root / "config.json"
    if not path.exists():
        raise CheckpointError(f"{root}: no config.json (is this a checkpoint directory?)")
    cfg = read_json(path)
    architecture = next((a for a in cfg.get("architectures") or [] if a in ARCHITECTURES), None)
    architecture = architecture or MODEL_TYPES.get(cfg.get("model_type"))
    if architecture is None:
        raise CheckpointError(
            f"{path}: architectures {cfg.get('architectures')} / model_type "
            f"{cfg.get('model_type')!r}: supported are {list(ARCHITECTURES)}"
        )
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: text_config is missing (a transformers >= 5 config)")
    generation = {}
    if (root / "generation_config.json").exists():
        generation = read_json(root / "generation_config.json")
    moe = architecture == ARCHITECTURES[1]
    out = ModelArchConfig(
        architecture=architecture,
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype"), path),
        text=_text_config(cfg, text, moe, path),
        vision=_vision_config(cfg.get("vision_config") or {}, path),
        tokens=_special_tokens(cfg, text, generation),
        video_pruning_rate=check_pruning_rate(cfg.get("video_pruning_rate") or 0.0, str(path)),
    )
    levels = len(out.vision.deepstack_visual_indexes)
    if levels > out.text.num_layers:
        raise CheckpointError(
            f"{path}: vision_config.deepstack_visual_indexes has {levels} levels, more than the "
            f"{out.text.num_layers} language-model layers they are added after"
        )
    if out.vision.out_hidden_size != out.text.hidden_size:
        raise CheckpointError(
            f"{path}: vision_config.out_hidden_size {out.vision.out_hidden_size} is not "
            f"text_config.hidden_size {out.text.hidden_size}"
        )
    return out


def _rope(text: dict[str, Any], path: Path) -> tuple[float, tuple[int, int, int]]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"{path}: text_config.rope_parameters.rope_type {rope_type!r} is not supported "
            "(only 'default': interleaved M-RoPE)"
        )
    if params.get("mrope_interleaved", True) is not True:
        raise CheckpointError(
            f"{path}: text_config.rope_parameters.mrope_interleaved must be true for Qwen3-VL "
            f"(got {params.get('mrope_interleaved')!r})"
        )
    section = params.get("mrope_section")
    if not section or len(section) != 3:
        raise CheckpointError(
            f"{path}: text_config.rope_parameters.mrope_section must list 3 sizes, got {section!r}"
        )
    theta = params.get("rope_theta", text.get("rope_theta", 5_000_000.0))
    return float(theta), tuple(int(s) for s in section)  # type: ignore[return-value]


def _text_config(cfg: dict[str, Any], text: dict[str, Any], moe: bool, path: Path) -> TextConfig:
    try:
        theta, section = _rope(text, path)
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        tie = cfg.get("tie_word_embeddings")
        if tie is None:
            tie = text.get("tie_word_embeddings", False)
        out = TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            mrope_section=section,
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 128000)),
            attention_bias=bool(text.get("attention_bias", False)),
            moe=_moe_config(text, path) if moe else None,
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: text_config is missing {e.args[0]!r}") from e
    if out.num_heads % out.num_kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads {out.num_heads} is not a multiple of "
            f"num_key_value_heads {out.num_kv_heads}"
        )
    if sum(out.mrope_section) * 2 != out.head_dim:
        raise CheckpointError(
            f"{path}: text_config.rope_parameters.mrope_section {list(out.mrope_section)} must "
            f"sum to head_dim / 2 = {out.head_dim // 2}"
        )
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: text_config.hidden_act {text['hidden_act']!r}: only silu")
    if text.get("use_sliding_window") or text.get("sliding_window"):
        raise CheckpointError(f"{path}: text_config.sliding_window is not supported")
    return out


def _moe_config(text: dict[str, Any], path: Path) -> MoEConfig:
    # transformers >= 5 writes `num_local_experts`; released configs say `num_experts`.
    if "num_experts" not in text and "num_local_experts" in text:
        text = {**text, "num_experts": text["num_local_experts"]}
    try:
        out = MoEConfig(
            num_experts=int(text["num_experts"]),
            top_k=int(text["num_experts_per_tok"]),
            intermediate_size=int(text["moe_intermediate_size"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: text_config is missing {e.args[0]!r} (MoE)") from e
    if not 1 <= out.top_k <= out.num_experts:
        raise CheckpointError(
            f"{path}: text_config.num_experts_per_tok {out.top_k} must be in "
            f"[1, num_experts = {out.num_experts}]"
        )
    if out.decoder_sparse_step < 1:
        raise CheckpointError(f"{path}: text_config.decoder_sparse_step must be >= 1")
    return out


def _vision_config(v: dict[str, Any], path: Path) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise CheckpointError(
            f"{path}: vision_config.rope_parameters.rope_type {rope['rope_type']!r}: only 'axial'"
        )
    out = VisionConfig(
        depth=int(v.get("depth", 27)),
        hidden_size=int(v.get("hidden_size", 1152)),
        num_heads=int(v.get("num_heads", 16)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(
            int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))
        ),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if out.hidden_size % out.num_heads or out.head_dim % 4:
        raise CheckpointError(
            f"{path}: vision_config.hidden_size {out.hidden_size} / num_heads {out.num_heads} "
            "must give a head_dim divisible by 4 (2-D rotary embedding)"
        )
    if out.grid_side**2 != out.num_position_embeddings or out.grid_side < 2:
        raise CheckpointError(
            f"{path}: vision_config.num_position_embeddings {out.num_position_embeddings} must "
            "be a square grid (side >= 2)"
        )
    indexes = out.deepstack_visual_indexes
    if any(not 0 <= i < out.depth for i in indexes) or len(set(indexes)) != len(indexes):
        raise CheckpointError(
            f"{path}: vision_config.deepstack_visual_indexes {list(indexes)} must be distinct "
            f"blocks of the {out.depth}-block tower"
        )
    if out.hidden_act not in ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu"):
        raise CheckpointError(
            f"{path}: vision_config.hidden_act {out.hidden_act!r} is not supported"
        )
    return out
