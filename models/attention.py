"""The attention interface every family's LM calls.

The LM is written against `AttentionBackend` only: each decoder layer hands it the step's
rotated queries, keys and values for all tokens of all sequences, packed back to back, plus an
opaque `attn_metadata` the engine built for the step. The backend owns the KV cache, so the
model knows nothing about blocks, slots or CUDA graphs. The LM worker supplies a paged backend
(lm_worker/attention.py); the reference path a contiguous one (models/testing/attention.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, num_heads, head_dim], rotary applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotary applied
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        attn_metadata: Any,
        sliding_window: int | None = None,  # each query sees itself and the W - 1 before it
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
