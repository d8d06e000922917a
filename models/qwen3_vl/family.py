"""The Qwen3-VL family (dense and MoE). What the roles see of it is
models.family.ModelFamily; much of it is the Qwen2-VL family's (tokenizer, placeholders, image
preprocessing, M-RoPE positions), with its own tower, LM, embedding shape and video
(models/qwen3_vl/processing.py: each temporal patch its own timestamped run in the prompt,
positioned as an image of its own).

Each media item's embedding is [tokens, 1 + deepstack levels, hidden] (models/qwen3_vl/
vision.py): one cache entry per item, its level count in the wire header's shape.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import cached_property

import torch

from models.attention import AttentionBackend
from models.checkpoint import CheckpointError, weights_fingerprint
from models.family import EmbeddingMismatch, LoadedEmbedding
from models.qwen2_vl.config import load_processor_configs
from models.qwen2_vl.family import MRopeState, Qwen2VLFamily
from models.qwen2_vl.processing import DEFAULT_MAX_IMAGE_PIXELS
from models.qwen2_vl.vision import VISION_TENSORS
from models.qwen3_vl.config import ModelArchConfig, load_arch_config
from models.qwen3_vl.language_model import Qwen3LanguageModel
from models.qwen3_vl.processing import IMAGE_DEFAULTS, VIDEO_DEFAULTS, Qwen3MediaProcessor
from models.qwen3_vl.vision import VisionTower

# Bump when our preprocessing or tower numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1


class DeepstackState(MRopeState):
    """M-RoPE positions as Qwen2-VL's images take them; embeddings [rows, levels, hidden]."""

    def __init__(self, model, hidden_size: int, spatial_merge_size: int, num_levels: int):
        super().__init__(model, hidden_size, spatial_merge_size, tokens_per_second=None)
        self.num_levels = num_levels

    def process_mm_embeds(self, mm_hash: str, embeds: torch.Tensor, num_embeds: int):
        want = (num_embeds, self.num_levels, self.hidden_size)
        if tuple(embeds.shape) != want:
            raise EmbeddingMismatch(
                f"embedding {mm_hash} has shape {tuple(embeds.shape)}; this model takes "
                f"{want} ([placeholders, main + deepstack levels, hidden])"
            )
        return LoadedEmbedding(embeds)


class Qwen3VLFamily(Qwen2VLFamily):
    architectures = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")

    @cached_property
    def arch(self) -> ModelArchConfig:  # type: ignore[override]
        return load_arch_config(self.path)

    def __init__(self, path, options=None):
        super().__init__(path, options)
        if self.options.video_pruning_rate:  # the cluster's setting: refused, never ignored
            raise CheckpointError(
                f"{self.path}: video_pruning_rate {self.options.video_pruning_rate}: EVS is not "
                "served for Qwen3-VL yet (nor is its video); set it to 0"
            )

    @property
    def video_pruning_rate(self) -> float:
        return 0.0

    def processor(self, max_image_pixels: int | None = None) -> Qwen3MediaProcessor:
        o = self.options
        limits = {"max_frames": o.max_video_frames, "max_video_seconds": o.max_video_seconds}
        tokens = self.arch.tokens
        return Qwen3MediaProcessor.from_checkpoint(
            self.path,
            self.tokenizer().encode,
            (tokens.vision_start_token_id, tokens.video_token_id, tokens.vision_end_token_id),
            max_image_pixels=max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS,
            **{k: v for k, v in limits.items() if v is not None},
        )

    def fingerprint(self, dtype: torch.dtype) -> str:
        image, video = load_processor_configs(self.path, IMAGE_DEFAULTS, VIDEO_DEFAULTS)
        settings = {
            "code": EMBEDDING_CODE_VERSION,
            "family": "qwen3_vl",
            "dtype": str(dtype).removeprefix("torch."),
            "vision": asdict(self.arch.vision),
            "image": asdict(image),
            "video": asdict(video),
        }
        return weights_fingerprint(self.path, VISION_TENSORS, settings)

    def load_tower(self, dtype: torch.dtype, device: torch.device) -> VisionTower:  # type: ignore[override]
        return VisionTower.from_checkpoint(self.path, self.arch.vision, dtype, device)

    def language_model(  # type: ignore[override]
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device
    ) -> Qwen3LanguageModel:
        """The LM as the checkpoint holds it (projections not merged: the reference's)."""
        return Qwen3LanguageModel.from_checkpoint(
            self.path, self.arch.text, attn_backend, dtype, device, self.arch.vision.num_levels
        )

    def model_state(self, model) -> DeepstackState:
        return DeepstackState(
            model,
            self.text.hidden_size,
            self.arch.vision.spatial_merge_size,
            self.arch.vision.num_levels,
        )
