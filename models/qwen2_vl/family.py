"""The Qwen2-VL family (Qwen2-VL and Qwen2.5-VL): images and video, one vision tower, the
Qwen2 LM with M-RoPE. What the roles see of it is models.family.ModelFamily."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from models.attention import AttentionBackend
from models.checkpoint import CheckpointError, weights_fingerprint
from models.family import EmbeddingMismatch, LoadedEmbedding, ModelFamily, ModelState, TextDims
from models.media import MMFeature, Modality, ProcessedMedia
from models.qwen2_vl.config import (
    ModelArchConfig,
    check_pruning_rate,
    load_arch_config,
    load_processor_configs,
)
from models.qwen2_vl.evs import POSITION_CHANNELS, prune_video, split_positions
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.qwen2_vl.processing import DEFAULT_MAX_IMAGE_PIXELS, MediaProcessor
from models.qwen2_vl.rope import MediaSpan, frame_spans, mrope_positions, num_placeholder_tokens
from models.qwen2_vl.vision import VISION_TENSORS, VisionTower
from models.tokenizer import Tokenizer

# Bump when our preprocessing or tower numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1

PLACEHOLDER_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}


class VisionEncoder:
    """The vision tower behind models.family.MediaEncoder: images and video in one forward.

    With EVS on (`video_pruning_rate` > 0) a video's output is pruned after the tower and
    carries its kept tokens' M-RoPE positions as trailing channels (models/qwen2_vl/evs.py)."""

    def __init__(self, tower: VisionTower, device: torch.device, video_pruning_rate: float = 0.0):
        self.tower = tower
        self.device = device
        self.dtype = tower.dtype
        self.width = tower.config.out_hidden_size
        self.video_pruning_rate = video_pruning_rate

    def embed(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        pixels = torch.cat([m.pixel_values for m in batch])  # [sum of t*h*w, C * T * P * P]
        if self.device.type == "cuda":
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        outputs = self.tower.embed_multimodal(pixels, [m.grid.grid_thw for m in batch])
        if self.video_pruning_rate <= 0:
            return outputs
        config = self.tower.config
        return [
            prune_video(
                out,
                m.grid.grid_thw,
                config.spatial_merge_size,
                self.video_pruning_rate,
                m.grid.second_per_grid_t,
                config.tokens_per_second,
            )
            if m.grid.modality == "video"
            else out
            for out, m in zip(outputs, batch, strict=True)
        ]


class MRopeState(ModelState):
    """M-RoPE: positions [3, T] from the prompt's media grids; past the prompt, index + delta
    on all three axes. The per-request state is (prompt positions [3, P], delta)."""

    position_axes = 3

    def __init__(
        self,
        model,
        hidden_size: int,
        spatial_merge_size: int,
        tokens_per_second,
        video_pruning_rate: float = 0.0,
    ):
        super().__init__(model, hidden_size)
        self.spatial_merge_size = spatial_merge_size
        self.tokens_per_second = tokens_per_second  # Qwen2.5-VL video time scale; else None
        self.video_pruning_rate = video_pruning_rate

    def process_mm_embeds(self, mm_hash: str, embeds: torch.Tensor, num_embeds: int):
        """EVS: a pruned video's embedding is POSITION_CHANNELS wider than the hidden size;
        split off its kept tokens' positions ([n, 3] t, h, w) for rope_state."""
        pruned_width = self.hidden_size + POSITION_CHANNELS
        if embeds.dim() != 2 or embeds.shape[1] != pruned_width:
            return super().process_mm_embeds(mm_hash, embeds, num_embeds)
        if self.video_pruning_rate <= 0:
            raise EmbeddingMismatch(
                f"embedding {mm_hash} is pruned ({pruned_width} wide, EVS position channels) "
                "but video pruning is off on this worker"
            )
        stripped, positions = split_positions(embeds, self.hidden_size)
        loaded = super().process_mm_embeds(mm_hash, stripped, num_embeds)
        widths = positions[:, 3].unique()
        if len(positions) and (len(widths) != 1 or (positions[:, :3] < 0).any()):
            raise EmbeddingMismatch(f"embedding {mm_hash} has inconsistent EVS position channels")
        return LoadedEmbedding(loaded.embeds, positions)

    def rope_state(
        self,
        num_prompt_tokens: int,
        features: Sequence[MMFeature],
        media_positions: Mapping[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, int]:
        media_positions = media_positions or {}
        spans = []
        for f in features:
            if f.grid_thw is not None and f.modality in ("image", "video"):
                spans += self.item_spans(f, media_positions.get(f.mm_hash), token_ids)
        positions, delta = mrope_positions(
            num_prompt_tokens, spans, self.spatial_merge_size, self.tokens_per_second
        )
        return positions.numpy(), delta

    def item_spans(
        self, f: MMFeature, kept: Any, token_ids: Sequence[int] | None
    ) -> list[MediaSpan]:
        """The M-RoPE spans of one item: itself; a span per frame where text stands between
        its frames (is_embed); with its kept tokens' positions where EVS pruned it."""
        if f.is_embed is not None:  # text between its frames: a span per frame
            try:
                return frame_spans(f.offset, f.grid_thw, f.is_embed, self.spatial_merge_size)
            except ValueError as e:
                raise EmbeddingMismatch(f"{f.mm_hash}: {e}") from None
        if kept is not None:
            grid_w = f.grid_thw[2] // self.spatial_merge_size
            if len(kept) != f.length or (len(kept) and int(kept[0, 3]) != grid_w):
                raise EmbeddingMismatch(
                    f"embedding {f.mm_hash}: {len(kept)} pruned positions of grid width "
                    f"{int(kept[0, 3]) if len(kept) else 0} for {f.length} placeholders of "
                    f"grid {f.grid_thw}"
                )
            kept = kept[:, :3]
        elif f.modality == "video" and self.video_pruning_rate > 0:
            full = num_placeholder_tokens(f.grid_thw, self.spatial_merge_size)
            if f.length != full:
                raise EmbeddingMismatch(
                    f"video {f.mm_hash} has {f.length} placeholders of {full} (pruned) but "
                    "its embedding carries no EVS positions"
                )
        return [MediaSpan(f.offset, f.grid_thw, f.modality, f.second_per_grid_t, kept)]

    def rope_delta(self, rope: Any) -> int | None:
        return int(rope[1])

    def rope_past_media(self, num_prompt_tokens: int, delta: int | None) -> Any:
        # Past the last image or video, M-RoPE's three axes are all index + delta.
        if delta is None:
            raise ValueError("M-RoPE positions past the media need the prefill's delta")
        past = np.arange(num_prompt_tokens, dtype=np.int64) + delta
        return np.broadcast_to(past, (3, num_prompt_tokens)), int(delta)

    def positions(self, rope: Any, num_prompt_tokens: int, start: int, end: int) -> np.ndarray:
        prompt_positions, delta = rope
        if start >= num_prompt_tokens:  # decode (or recompute of outputs)
            return np.broadcast_to(np.arange(start, end) + delta, (3, end - start))
        if end <= num_prompt_tokens:
            return prompt_positions[:, start:end]
        tail = np.arange(num_prompt_tokens, end) + delta
        return np.concatenate(
            [prompt_positions[:, start:], np.broadcast_to(tail, (3, end - num_prompt_tokens))],
            axis=1,
        )


class Qwen2VLFamily(ModelFamily):
    architectures = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    embedding_code_version: ClassVar[int] = EMBEDDING_CODE_VERSION
    # (image, video) ProcessorConfig defaults for what the checkpoint's files leave out (None:
    # Qwen2-VL's own).
    processor_defaults: ClassVar[tuple[Any, Any]] = (None, None)

    @cached_property
    def video_pruning_rate(self) -> float:
        """EVS: the configured rate, else config.json's `video_pruning_rate` (0: off)."""
        if self.options.video_pruning_rate is not None:
            return check_pruning_rate(self.options.video_pruning_rate, "video_pruning_rate")
        return self.arch.video_pruning_rate

    @cached_property
    def arch(self) -> ModelArchConfig:
        return load_arch_config(self.path)

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def dtype(self) -> torch.dtype:
        return self.arch.dtype

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("image", "video")

    @cached_property
    def text(self) -> TextDims:
        return TextDims.of(self.arch.text)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.tokens.eos_token_ids

    @property
    def placeholder_token_ids(self) -> dict[Modality, int]:
        tokens = self.arch.tokens
        return {"image": tokens.image_token_id, "video": tokens.video_token_id}

    def tokenizer(self) -> Tokenizer:
        tokenizer = Tokenizer.from_dir(self.path)
        for modality, token in PLACEHOLDER_TOKENS.items():
            if tokenizer.required_id(token) != self.placeholder_token_ids[modality]:
                raise CheckpointError(
                    f"{self.path}: tokenizer.json's {token} is not config.json's "
                    f"{modality}_token_id"
                )
        return tokenizer

    def processor(self, max_image_pixels: int | None = None) -> MediaProcessor:
        o = self.options
        limits = {"max_frames": o.max_video_frames, "max_video_seconds": o.max_video_seconds}
        return self.make_processor(
            max_image_pixels=max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS,
            video_pruning_rate=self.video_pruning_rate,
            **{k: v for k, v in limits.items() if v is not None},
        )

    def make_processor(self, **settings: Any) -> MediaProcessor:
        """The family's processor class over the checkpoint, with `processor`'s settings."""
        return MediaProcessor.from_checkpoint(self.path, **settings)

    def fingerprint(self, dtype: torch.dtype) -> str:
        image, video = load_processor_configs(self.path, *self.processor_defaults)
        settings = {
            "code": self.embedding_code_version,
            "dtype": str(dtype).removeprefix("torch."),
            "vision": asdict(self.arch.vision),
            "image": asdict(image),
            "video": asdict(video),
            # Pruned and unpruned outputs of one video differ: every role must agree on q.
            "video_pruning_rate": self.video_pruning_rate,
        }
        return weights_fingerprint(self.path, VISION_TENSORS, settings)

    def load_tower(self, dtype: torch.dtype, device: torch.device) -> VisionTower:
        """The vision tower alone (the encoder's, and the reference path's)."""
        return VisionTower.from_checkpoint(self.path, self.arch.vision, dtype, device)

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
        tower = self.load_tower(dtype, device)
        return VisionEncoder(tower, torch.device(device), self.video_pruning_rate)

    def load_language_model(
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> Qwen2LanguageModel:
        model = self.language_model(attn_backend, dtype, device)
        model.merge_projections()  # the serving model; the reference keeps the checkpoint's
        return model

    def language_model(
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device
    ) -> Qwen2LanguageModel:
        """The LM as the checkpoint holds it (projections not merged: the reference's)."""
        return Qwen2LanguageModel.from_checkpoint(
            self.path, self.arch.text, attn_backend, dtype, device
        )

    def model_state(self, model) -> MRopeState:
        vision = self.arch.vision
        return MRopeState(
            model,
            self.text.hidden_size,
            vision.spatial_merge_size,
            vision.tokens_per_second,
            self.video_pruning_rate,
        )
