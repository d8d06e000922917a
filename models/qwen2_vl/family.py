"""The Qwen2-VL family (Qwen2-VL and Qwen2.5-VL): images and video, one vision tower, the
Qwen2 LM with M-RoPE. What the roles see of it is models.family.ModelFamily."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from functools import cached_property
from typing import Any

import numpy as np
import torch

from models.attention import AttentionBackend
from models.checkpoint import CheckpointError, weights_fingerprint
from models.family import ModelFamily, ModelState, TextDims
from models.media import MMFeature, Modality, ProcessedMedia
from models.qwen2_vl.config import ModelArchConfig, load_arch_config, load_processor_configs
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.qwen2_vl.processing import DEFAULT_MAX_IMAGE_PIXELS, MediaProcessor
from models.qwen2_vl.rope import MediaSpan, mrope_positions
from models.qwen2_vl.vision import VISION_TENSORS, VisionTower
from models.tokenizer import Tokenizer

# Bump when our preprocessing or tower numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1

PLACEHOLDER_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}


class VisionEncoder:
    """The vision tower behind models.family.MediaEncoder: images and video in one forward."""

    def __init__(self, tower: VisionTower, device: torch.device):
        self.tower = tower
        self.device = device
        self.dtype = tower.dtype
        self.width = tower.config.out_hidden_size

    def embed(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        pixels = torch.cat([m.pixel_values for m in batch])  # [sum of t*h*w, C * T * P * P]
        if self.device.type == "cuda":
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        return self.tower.embed_multimodal(pixels, [m.grid.grid_thw for m in batch])


class MRopeState(ModelState):
    """M-RoPE: positions [3, T] from the prompt's media grids; past the prompt, index + delta
    on all three axes. The per-request state is (prompt positions [3, P], delta)."""

    position_axes = 3

    def __init__(self, model, hidden_size: int, spatial_merge_size: int, tokens_per_second):
        super().__init__(model, hidden_size)
        self.spatial_merge_size = spatial_merge_size
        self.tokens_per_second = tokens_per_second  # Qwen2.5-VL video time scale; else None

    def rope_state(
        self, num_prompt_tokens: int, features: Sequence[MMFeature]
    ) -> tuple[np.ndarray, int]:
        spans = [
            MediaSpan(f.offset, f.grid_thw, f.modality, f.second_per_grid_t)
            for f in features
            if f.grid_thw is not None and f.modality in ("image", "video")
        ]
        positions, delta = mrope_positions(
            num_prompt_tokens, spans, self.spatial_merge_size, self.tokens_per_second
        )
        return positions.numpy(), delta

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
        t = self.arch.text
        return TextDims(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            max_position_embeddings=t.max_position_embeddings,
        )

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

    def processor(
        self, max_image_pixels: int | None = None, max_audio_seconds: float | None = None
    ) -> MediaProcessor:
        return MediaProcessor.from_checkpoint(
            self.path, max_image_pixels=max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS
        )

    def fingerprint(self, dtype: torch.dtype) -> str:
        image, video = load_processor_configs(self.path)
        settings = {
            "code": EMBEDDING_CODE_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
            "vision": asdict(self.arch.vision),
            "image": asdict(image),
            "video": asdict(video),
        }
        return weights_fingerprint(self.path, VISION_TENSORS, settings)

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
        tower = VisionTower.from_checkpoint(self.path, self.arch.vision, dtype, device)
        return VisionEncoder(tower, torch.device(device))

    def load_language_model(
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> Qwen2LanguageModel:
        return Qwen2LanguageModel.from_checkpoint(
            self.path, self.arch.text, attn_backend, dtype, device
        )

    def model_state(self, model) -> MRopeState:
        vision = self.arch.vision
        return MRopeState(
            model, self.text.hidden_size, vision.spatial_merge_size, vision.tokens_per_second
        )
