"""M-RoPE: the LM's 3-D rotary positions (time, height, width) and the rotary math.

Text tokens move along all three axes together (t = h = w = position). A media item's
placeholder run takes a grid of positions that starts where the text before it ended: height and
width are its merged-patch row and column, time is the temporal patch index (for Qwen2.5-VL
video scaled by tokens_per_second * second_per_grid_t, so positions follow real seconds).
Text after an item resumes at start + max(grid_h, grid_w) / merge_size.

Decoding continues from `mrope_position_delta`: the token at sequence index i >= prompt length
sits at position i + delta on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from models.layers import inverse_frequencies


@dataclass(frozen=True)
class MediaSpan:
    """Where one media item's placeholder run sits in a prompt, and its patch grid."""

    offset: int  # index of the run's first token
    grid_thw: tuple[int, int, int]  # patches along (time, height, width), before merging
    modality: Literal["image", "video"]
    second_per_grid_t: float | None = None  # video only (Qwen2.5-VL)
    # EVS: the kept tokens' (t, h, w) positions [n, 3] as if the item stood at position 0; the
    # run then holds n tokens. None: every token of the grid, positions from the grid.
    positions: torch.Tensor | None = None


def frame_spans(
    offset: int, grid_thw: Sequence[int], is_embed: Sequence[bool], spatial_merge_size: int
) -> list[MediaSpan]:
    """An item whose run holds text between its frames (Qwen3-VL video: timestamps and vision
    markers; `is_embed` flags its placeholders): one span per temporal patch, at its own
    placeholders, positioned as a still image (time fixed, height and width its grid), with
    the text between them positioned as text. ValueError when the flags do not fit the grid."""
    t, h, w = grid_thw
    per_frame = h * w // spatial_merge_size**2
    flags = np.asarray(is_embed, dtype=bool)
    starts = np.flatnonzero(flags & ~np.concatenate([[False], flags[:-1]]))
    if len(starts) != t or flags.sum() != t * per_frame:
        raise ValueError(
            f"{int(flags.sum())} placeholders in {len(starts)} runs for a video of grid "
            f"{tuple(grid_thw)} ({t} runs of {per_frame})"
        )
    return [MediaSpan(offset + int(s), (1, h, w), "image") for s in starts]


def num_placeholder_tokens(grid_thw: Sequence[int], spatial_merge_size: int) -> int:
    t, h, w = grid_thw
    return t * h * w // spatial_merge_size**2


def mrope_positions(
    num_tokens: int,
    spans: Sequence[MediaSpan],
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) for a prompt, and its decode-time delta.

    `tokens_per_second` is Qwen2.5-VL's vision config value (None for Qwen2-VL, whose video
    frames step by one position per temporal patch).
    """
    m = spatial_merge_size
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index
    pos = 0  # next text position
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset < cursor:
            raise ValueError(f"media spans overlap at token {span.offset}")
        if span.offset > cursor:
            pieces.append(torch.arange(span.offset - cursor).expand(3, -1) + pos)
            pos += span.offset - cursor
        t, h, w = span.grid_thw[0], span.grid_thw[1] // m, span.grid_thw[2] // m
        if span.positions is not None:
            # A pruned item: its kept tokens' own positions; text resumes as after the whole
            # grid, so the text around a video sits where it would with every token kept.
            pieces.append(span.positions.T.long() + pos)
            pos += max(h, w)
            cursor = span.offset + span.positions.shape[0]
            continue
        temporal = torch.arange(t)
        if span.modality == "video" and tokens_per_second is not None:
            if span.second_per_grid_t is None:
                raise ValueError("a Qwen2.5-VL video span needs second_per_grid_t")
            # NOTE: float32 product truncated toward zero, exactly as the reference computes it.
            interval = torch.tensor(span.second_per_grid_t, dtype=torch.float32) * tokens_per_second
            temporal = (temporal * interval).long()
        grid = torch.stack(
            torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
        ).reshape(3, -1)
        pieces.append(grid + pos)
        # NOTE: the reference (transformers 5) resumes text at start + max(h, w), even when a
        # video's scaled time positions run past that; the delta below still uses the max.
        pos += max(h, w)
        cursor = span.offset + t * h * w
    if cursor > num_tokens:
        raise ValueError(f"media spans end at token {cursor}, past the prompt ({num_tokens})")
    if num_tokens > cursor:
        pieces.append(torch.arange(num_tokens - cursor).expand(3, -1) + pos)
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - num_tokens
    return positions, delta


def mrope_decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions [3, count] of tokens at sequence indices start .. start + count - 1."""
    return (torch.arange(start, start + count) + delta).expand(3, -1).clone()


def mrope_freq_axes(mrope_section: Sequence[int], interleaved: bool = False) -> list[int]:
    """The position axis (0 time, 1 height, 2 width) each of the head_dim / 2 rotary
    frequencies turns with. Qwen2-VL / Qwen2.5-VL: in chunks (the first section[0]
    frequencies with time, the next section[1] with height, then width). Qwen3-VL
    (`mrope_interleaved`): t, h, w, t, h, w, ... while each axis has frequencies left
    (frequency j is height when j % 3 == 1 and j < 3 section[1], width when j % 3 == 2 and
    j < 3 section[2], time otherwise)."""
    if not interleaved:
        return [axis for axis, size in enumerate(mrope_section) for _ in range(size)]
    axes = []
    for j in range(sum(mrope_section)):
        if j % 3 == 1 and j < 3 * mrope_section[1]:
            axes.append(1)
        elif j % 3 == 2 and j < 3 * mrope_section[2]:
            axes.append(2)
        else:
            axes.append(0)
    return axes


class MRotaryEmbedding(torch.nn.Module):
    """cos / sin [T, head_dim] for M-RoPE positions [3, T] (or plain positions [T])."""

    def __init__(
        self, head_dim: int, theta: float, mrope_section: Sequence[int], interleaved: bool = False
    ):
        super().__init__()
        assert sum(mrope_section) * 2 == head_dim, (mrope_section, head_dim)
        self.mrope_section = list(mrope_section)
        self.freq_axis = mrope_freq_axes(mrope_section, interleaved)
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)
        # NOTE: explicit CPU tensors, so a model built under torch.device("meta") gets them.
        axis = torch.tensor(self.freq_axis, device="cpu")
        self.register_buffer("_axis", axis, persistent=False)
        self.register_buffer("_freq", torch.arange(len(axis), device="cpu"), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        # Frequency j rotates with its axis: [head_dim / 2, T] picked, then [T, head_dim / 2].
        freqs = freqs[self._axis, :, self._freq].T
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)
