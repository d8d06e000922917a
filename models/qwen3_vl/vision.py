"""The Qwen3-VL vision tower: what its encoder publishes per item is a main embedding plus
one deepstack level per `deepstack_visual_indexes` block.

Against the Qwen2-VL tower (models/qwen2_vl/vision.py, whose attention, rotary and packed
segments it reuses):

- 16-pixel patches through a Conv3d with a bias (Qwen2-VL's PatchEmbed, bias on);
- a learned position embedding on a side x side grid, resampled bilinearly (corners aligned)
  to each item's patch grid and added to the patch embeddings;
- LayerNorm blocks with a plain fc1 / fc2 MLP, full attention within each frame;
- besides the final merger, a deepstack merger after each listed block (its LayerNorm over
  the merged 2x2 block rather than each patch).

`forward` returns one [tokens, 1 + levels, out_hidden] tensor per item: row i's main
embedding, then its levels in order. Kept together, an item is one embedding-cache entry
whose wire header carries the level count (the middle dimension).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import assign_module_weights
from models.layers import inverse_frequencies
from models.qwen2_vl.vision import (
    _ACTIVATIONS,
    VISION_TENSORS,
    GridTHW,
    PatchEmbed,
    VisionBlock,
    _Segments,
    checked_grids,
    rotary_2d,
)
from models.qwen3_vl.config import VisionConfig


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches -> one token of the LM's width. The deepstack
    mergers (`postshuffle`) normalise the concatenated block, the final one each patch."""

    def __init__(self, config: VisionConfig, postshuffle: bool):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """pixel_values + grids of several items -> one [tokens, levels, width] tensor per item."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(
                config, lambda: nn.LayerNorm(config.hidden_size, eps=1e-6), VisionMLP(config)
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes
        )
        self.levels = {block: i for i, block in enumerate(config.deepstack_visual_indexes)}
        freqs = inverse_frequencies(config.head_dim // 2, config.rope_theta)
        self.register_buffer("inv_freq", freqs, persistent=False)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: VisionConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> VisionTower:
        """Build the tower and load its tensors (never the LM's). A tensor the config needs
        and the checkpoint lacks (a deepstack merger, say) is a CheckpointError naming it."""
        with torch.device("meta"):
            tower = cls(config)
        assign_module_weights(tower, checkpoint_dir, VISION_TENSORS, "vision", dtype, device)
        return tower.to(device).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> list[torch.Tensor]:
        return self(pixel_values, grid_thw)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> list[torch.Tensor]:
        m = self.config.spatial_merge_size
        grids = checked_grids(pixel_values, grid_thw, m)
        device = self.patch_embed.proj.weight.device
        x = self.patch_embed(pixel_values.to(device))  # [N, hidden]
        x = x + self._position_embeddings(grids, device).to(x.dtype)
        cos, sin = rotary_2d(grids, m, self.inv_freq, device)
        frames = _Segments([h * w for t, h, w in grids for _ in range(t)])
        levels: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.levels:
                levels.append(self.deepstack_merger_list[self.levels[i]](x))
        out = torch.stack([self.merger(x), *levels], dim=1)  # [tokens, levels, width]
        return list(out.split([t * h * w // (m * m) for t, h, w in grids]))

    def _position_embeddings(
        self, grids: Sequence[tuple[int, int, int]], device: torch.device
    ) -> torch.Tensor:
        """The learned grid resampled to each item's patches, bilinearly with corners aligned
        (source coordinate i (side - 1) / (n - 1)), in merge-block order, repeated per frame:
        [N, hidden]. Four taps a patch, summed in the reference's order."""
        side, m = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.weight
        out = []
        for t, h, w in grids:
            rows, row_w = _taps(h, side, device)  # [h, 2] each
            cols, col_w = _taps(w, side, device)
            index = (rows[:, None, :, None] * side + cols[None, :, None, :]).reshape(h, w, 4)
            weight = (row_w[:, None, :, None] * col_w[None, :, None, :]).reshape(h, w, 4)
            # Raster (h, w) -> merge-block order (h / m, w / m, m, m).
            index, weight = (
                a.view(h // m, m, w // m, m, 4).transpose(1, 2).reshape(h * w, 4)
                for a in (index, weight)
            )
            embeds = (table[index] * weight[:, :, None].to(table.dtype)).sum(1)
            out.append(embeds.repeat(t, 1))
        return torch.cat(out)


def _taps(n: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (corners aligned) source taps and weights for n positions on a side-long axis."""
    src = torch.arange(n, device=device, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
