"""A reference attention backend: one contiguous K / V tensor per sequence and layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ContiguousKVMetadata:
    """One step: which sequences its tokens belong to, in packing order."""

    seq_ids: tuple[int, ...]
    query_lens: tuple[int, ...]  # new tokens per sequence; they sum to T


class ContiguousKVAttention:
    """Causal attention over a growing, contiguous K / V tensor per sequence and layer.

    Prefill several sequences packed together, then decode them one token each per step
    (or any mix). Correct and simple, not fast: appending concatenates.
    """

    def __init__(self, num_layers: int, scale: float | None = None):
        self.num_layers = num_layers
        self.scale = scale
        self._cache: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def metadata(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> ContiguousKVMetadata:
        assert len(seq_ids) == len(query_lens)
        return ContiguousKVMetadata(tuple(seq_ids), tuple(query_lens))

    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for a sequence (0 if unknown)."""
        layers = self._cache.get(seq_id)
        return 0 if not layers or layers[0] is None else layers[0][0].shape[0]

    @property
    def num_sequences(self) -> int:
        """Sequences holding cache (freed ones excluded)."""
        return len(self._cache)

    def free(self, seq_id: int) -> None:
        self._cache.pop(seq_id, None)

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: ContiguousKVMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for seq_id, n in zip(attn_metadata.seq_ids, attn_metadata.query_lens, strict=True):
            layers = self._cache.setdefault(seq_id, [None] * self.num_layers)
            new_k, new_v = k[start : start + n], v[start : start + n]
            if layers[layer_idx] is not None:
                old_k, old_v = layers[layer_idx]
                new_k, new_v = torch.cat([old_k, new_k]), torch.cat([old_v, new_v])
            layers[layer_idx] = (new_k, new_v)
            out[start : start + n] = causal_attention(
                q[start : start + n], new_k, new_v, self.scale, sliding_window
            )
            start += n
        assert start == q.shape[0], (start, q.shape)
        return out


def causal_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: the last n of the L keys' positions
    k: torch.Tensor,  # [L, num_kv_heads, head_dim]
    v: torch.Tensor,  # [L, num_kv_heads, head_dim]
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    n, num_heads, _ = q.shape
    total = k.shape[0]
    groups = num_heads // k.shape[1]
    # Query i (0-based among the n new ones) sees keys 0 .. total - n + i.
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
    if sliding_window is not None:  # and no further back than sliding_window - 1 keys
        mask &= ~torch.ones_like(mask).tril(diagonal=total - n - sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(groups, dim=1).transpose(0, 1),
        v.repeat_interleave(groups, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)
