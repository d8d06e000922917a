"""The Qwen3-VL family (dense and MoE). What the roles see of it is
models.family.ModelFamily; much of it is the Qwen2-VL family's (tokenizer, placeholders, image
preprocessing, M-RoPE positions), with its own tower, LM, embedding shape and video
(models/qwen3_vl/processing.py: each temporal patch its own timestamped run in the prompt,
positioned as an image of its own).

Each media item's embedding is [tokens, 1 + deepstack levels, hidden] (models/qwen3_vl/
vision.py): one cache entry per item, its level count in the wire header's shape.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from models.attention import AttentionBackend
from models.family import EmbeddingMismatch, LoadedEmbedding
from models.media import MMFeature
from models.qwen2_vl.evs import POSITION_CHANNELS, split_positions
from models.qwen2_vl.family import MRopeState, Qwen2VLFamily
from models.qwen2_vl.rope import MediaSpan
from models.qwen3_vl.config import ModelArchConfig, load_arch_config
from models.qwen3_vl.language_model import Qwen3LanguageModel
from models.qwen3_vl.processing import IMAGE_DEFAULTS, VIDEO_DEFAULTS, Qwen3MediaProcessor
from models.qwen3_vl.vision import VisionTower

# Bump when our preprocessing or tower numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1


class DeepstackState(MRopeState):
    """M-RoPE positions as Qwen2-VL's images take them, a video's frames each an image of its
    own; embeddings [rows, levels, hidden].

    EVS: a pruned video's embedding carries its kept tokens' positions (models/qwen2_vl/
    evs.py: [rows, levels, hidden + 8]). How many tokens each frame kept is known only then,
    so the proxy's run holds the kept count spread evenly over the frames, and `relayout`
    moves the placeholders so each frame's run (timestamp, <|vision_start|>, placeholders,
    <|vision_end|>) holds the tokens it kept. A kept token keeps the position it has unpruned
    and the text around the frames keeps its own: pruning moves no other token's position."""

    def __init__(
        self,
        model,
        hidden_size: int,
        spatial_merge_size: int,
        num_levels: int,
        video_pruning_rate: float = 0.0,
        markers: tuple[int, int, int] = (-1, -1, -1),
    ):
        super().__init__(
            model, hidden_size, spatial_merge_size, None, video_pruning_rate=video_pruning_rate
        )
        self.num_levels = num_levels
        self.markers = markers  # <|vision_start|>, <|video_pad|>, <|vision_end|>

    def process_mm_embeds(self, mm_hash: str, embeds: torch.Tensor, num_embeds: int):
        positions = None
        if embeds.dim() == 3 and embeds.shape[2] == self.hidden_size + POSITION_CHANNELS:
            if self.video_pruning_rate <= 0:
                raise EmbeddingMismatch(
                    f"embedding {mm_hash} is pruned (EVS position channels) but video pruning "
                    "is off on this worker"
                )
            embeds, positions = split_positions(embeds, self.hidden_size)
        want = (num_embeds, self.num_levels, self.hidden_size)
        if tuple(embeds.shape) != want:
            raise EmbeddingMismatch(
                f"embedding {mm_hash} has shape {tuple(embeds.shape)}; this model takes "
                f"{want} ([placeholders, main + deepstack levels, hidden])"
            )
        return LoadedEmbedding(embeds, positions)

    def relayout(self, token_ids, feature: MMFeature, positions):
        if feature.is_embed is None or feature.grid_thw is None:
            return None
        run = list(token_ids[feature.offset : feature.offset + feature.length])
        frames = self._frames(run, feature)
        counts = np.bincount(positions[:, 0].numpy(), minlength=len(frames))
        if len(counts) != len(frames) or int(counts.sum()) != feature.num_embeds:
            raise EmbeddingMismatch(
                f"embedding {feature.mm_hash}: kept tokens of {len(counts)} frames for a run "
                f"of {len(frames)} frames and {feature.num_embeds} placeholders"
            )
        _, pad, end = self.markers
        laid: list[int] = []
        flags: list[bool] = []
        for (prefix, _), kept in zip(frames, counts.tolist(), strict=True):
            laid += [*prefix, *[pad] * kept, end]
            flags += [False] * len(prefix) + [True] * kept + [False]
        return laid, np.asarray(flags)

    def item_spans(self, f: MMFeature, kept, token_ids) -> list[MediaSpan]:
        if kept is None or f.is_embed is None or token_ids is None:
            return super().item_spans(f, kept, token_ids)
        # A pruned video, laid out: each frame's kept tokens at their unpruned positions.
        _, h, w = f.grid_thw
        frames = self._frames(list(token_ids[f.offset : f.offset + f.length]), f)
        spans, at, row = [], f.offset, 0
        for index, (prefix, count) in enumerate(frames):
            at += len(prefix)
            rows = kept[row : row + count, :3].clone()
            if (rows[:, 0] != index).any():
                raise EmbeddingMismatch(f"{f.mm_hash}: its run is not laid out as it was pruned")
            rows[:, 0] = 0  # a frame stands as an image: time fixed at its start
            spans.append(MediaSpan(at, (1, h, w), "image", positions=rows))
            at, row = at + count + 1, row + count
        return spans

    def _frames(self, run: list[int], f: MMFeature) -> list[tuple[list[int], int]]:
        """A video run's frames: (the tokens up to its <|vision_start|>, its placeholders)."""
        start, pad, end = self.markers
        frames, prefix, i = [], [], 0
        while i < len(run):
            prefix.append(run[i])
            i += 1
            if prefix[-1] != start:
                continue
            count = 0
            while i < len(run) and run[i] == pad:
                count, i = count + 1, i + 1
            if i == len(run) or run[i] != end:
                raise EmbeddingMismatch(f"{f.mm_hash}: a frame of its run is not closed")
            frames.append((prefix, count))
            prefix, i = [], i + 1
        if prefix or not frames:
            raise EmbeddingMismatch(f"{f.mm_hash}: its run does not end with a frame")
        return frames


class Qwen3VLFamily(Qwen2VLFamily):
    architectures = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
    embedding_code_version = EMBEDDING_CODE_VERSION
    processor_defaults = (IMAGE_DEFAULTS, VIDEO_DEFAULTS)

    @cached_property
    def arch(self) -> ModelArchConfig:  # type: ignore[override]
        return load_arch_config(self.path)

    @property
    def video_markers(self) -> tuple[int, int, int]:
        """<|vision_start|>, <|video_pad|>, <|vision_end|>: a video frame's run in the prompt."""
        t = self.arch.tokens
        return t.vision_start_token_id, t.video_token_id, t.vision_end_token_id

    def make_processor(self, **settings) -> Qwen3MediaProcessor:  # type: ignore[override]
        return Qwen3MediaProcessor.from_checkpoint(
            self.path, self.tokenizer().encode, self.video_markers, **settings
        )

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
            self.video_pruning_rate,
            self.video_markers,
        )
