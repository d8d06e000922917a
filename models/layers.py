"""Building blocks more than one family uses: RMSNorm and the rotary-embedding math."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalised in float32, cast back, then scaled: the reference's rounding order.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """[dim / 2] float32, as the reference computes them."""
    # NOTE: an explicit CPU device, so a model built under torch.device("meta") gets real values.
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    return 1.0 / (theta ** (steps / dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos / sin [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
