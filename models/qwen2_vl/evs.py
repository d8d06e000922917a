"""Efficient Video Sampling (EVS): prune a video's merged tokens that repeat the previous frame.

The rule (vLLM's `video_pruning_rate`, q in [0, 1)):
- the tower's output for a video is a grid (t, h / m, w / m) of merged tokens, frame-major;
- a token's dissimilarity is 1 - cosine similarity with the token at the same spatial position
  in the previous temporal patch; every token of the first temporal patch is kept;
- the `max(tokens_per_frame, int(total * (1 - q)))` most dissimilar tokens are kept, ties in
  favour of the earlier token (a stable descending sort), in their original order.

The count depends only on the grid and q, so a proxy knows a pruned video's placeholder count
from its header. The kept set depends on the content, so the LM cannot know the kept tokens'
M-RoPE positions in advance: the encoder appends them to each kept embedding as trailing
channels, computed as if the video stood at position 0:

    t (the temporal position, Qwen2.5-VL's seconds-scaled index), h, w, and the grid width

Each channel is split into two exact halves (value // 256, value % 256): integers below 256 are
exact in bf16, fp16 and fp32 alike, so positions survive any embedding dtype. The published
embedding is [kept, hidden + 8]; the LM strips the 8 channels and places the video's positions at
the prompt position where its placeholders start.
"""

from __future__ import annotations

import torch

from models.media import MediaError

POSITION_FIELDS = 4  # t, h, w, grid width
POSITION_CHANNELS = 2 * POSITION_FIELDS
MAX_POSITION = 256 * 256 - 1


def retained_count(grid_thw: tuple[int, int, int], merge_size: int, q: float) -> int:
    """Merged tokens EVS keeps of a video with this patch grid."""
    t, h, w = grid_thw
    per_frame = (h // merge_size) * (w // merge_size)
    return max(per_frame, int(t * per_frame * (1 - q)))


def retention_mask(
    embeds: torch.Tensor, grid_thw: tuple[int, int, int], merge_size: int, q: float
) -> torch.Tensor:
    """[t * h/m * w/m] bool: the tokens kept of a video's merged embeddings (frame-major)."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    x = embeds.reshape(t, h, w, embeds.shape[-1]).float()
    dissimilarity = 1 - torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)
    # Above any dissimilarity (which is at most 2): the first frame sorts first.
    first = torch.full_like(x[:1, :, :, 0], 255.0)
    flat = torch.cat([first, dissimilarity]).reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order[: retained_count(grid_thw, merge_size, q)]] = True
    return mask


def video_positions(
    grid_thw: tuple[int, int, int],
    merge_size: int,
    second_per_grid_t: float | None,
    tokens_per_second: float | None,
) -> torch.Tensor:
    """[t * h/m * w/m, 4] int64 (t, h, w, grid width) of a video's merged tokens at position 0.

    Temporal positions as the unpruned path computes them: Qwen2.5-VL scales the patch index by
    second_per_grid_t * tokens_per_second (a float32 product, truncated toward zero); Qwen2-VL
    (tokens_per_second None) steps one position per temporal patch."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    temporal = torch.arange(t)
    if tokens_per_second is not None:
        if second_per_grid_t is None:
            raise MediaError("a Qwen2.5-VL video needs second_per_grid_t")
        interval = torch.tensor(second_per_grid_t, dtype=torch.float32) * tokens_per_second
        temporal = (temporal * interval).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    width = torch.full((t * h * w,), w)
    return torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1), width], dim=1)


def append_positions(embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n, hidden] embeddings + [n, 4] positions -> [n, hidden + 8] (exact in any dtype);
    [n, levels, hidden] (Qwen3-VL's deepstack levels) -> [n, levels, hidden + 8], each level
    carrying its row's positions."""
    if positions.numel() and int(positions.max()) > MAX_POSITION:
        raise MediaError(
            f"the video's temporal positions reach {int(positions.max())}, above what EVS "
            f"position channels carry ({MAX_POSITION})"
        )
    halves = torch.stack([positions // 256, positions % 256], dim=-1).reshape(len(positions), -1)
    if embeds.dim() == 3:
        halves = halves[:, None].expand(-1, embeds.shape[1], -1)
    return torch.cat([embeds, halves.to(embeds.device, embeds.dtype)], dim=-1)


def split_positions(embeds: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of append_positions: ([n, hidden] (or [n, levels, hidden]) embeddings,
    [n, 4] int64 positions)."""
    channels = embeds[:, hidden_size:] if embeds.dim() == 2 else embeds[:, 0, hidden_size:]
    pairs = channels.float().round().long().cpu().reshape(len(embeds), POSITION_FIELDS, 2)
    return embeds[..., :hidden_size], pairs[..., 0] * 256 + pairs[..., 1]


def prune_video(
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    merge_size: int,
    q: float,
    second_per_grid_t: float | None,
    tokens_per_second: float | None,
) -> torch.Tensor:
    """A video's merged embeddings ([tokens, width], or [tokens, levels, width] with the mask
    taken on the main embedding, level 0) -> the kept ones with their positions appended."""
    mask = retention_mask(embeds if embeds.dim() == 2 else embeds[:, 0], grid_thw, merge_size, q)
    positions = video_positions(grid_thw, merge_size, second_per_grid_t, tokens_per_second)
    positions = positions[mask.cpu()]
    return append_positions(embeds[mask.to(embeds.device)], positions)
