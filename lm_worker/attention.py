"""Attention over a paged KV cache, in PyTorch (CPU and CUDA; the decode path is capturable in
a CUDA graph), with decode on a GPU in a Triton kernel (lm_worker/triton_decode.py) that reads
only the blocks each sequence uses, and prefill there optionally in one
(lm_worker/triton_prefill.py, `lm.prefill_attention: triton`).

The cache is one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].
A step's tokens come packed: first `num_decodes` sequences with one new token each, then the
prefill chunks. Every token's K / V is written to its slot (block_id * block_size + offset);
then decodes attend in one batched call over their block tables, and each prefill chunk attends
over its cached prefix plus itself, causally.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lm_worker.huge_pages import empty as huge_pages_empty

logger = logging.getLogger(__name__)


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; padded tokens write to the null block
    num_decodes: int  # leading sequences with one token each (padded count under graphs)
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, tokens incl. the new one (>= 1)
    # Prefill chunks, in order after the decode tokens (eager only: Python lists).
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]  # cached prefix + this chunk
    prefill_block_tables: list[torch.Tensor]  # each [num_blocks_i] int64
    # The decode sequences' key masks by sliding window, made by a forward's first layer.
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # The batch-invariant kernel's query tiles (lm_worker/triton_invariant.py), made once.
    invariant_tiles: tuple | None = None
    # The Triton prefill kernel's view of the prefill chunks (lm_worker/triton_prefill.py),
    # made by a forward's first layer that needs it.
    prefill_plan: Any = None


class PagedAttention:
    """The engine's attention backend (models.attention.AttentionBackend)."""

    def __init__(self, block_size: int, head_dim: int, triton_prefill: bool = False):
        self.block_size = block_size
        self.triton_prefill = triton_prefill  # on a GPU: lm.prefill_attention = triton
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None  # allocated once the model is loaded
        # Decode and prefill on a GPU: the Triton kernels' modules (set by `allocate`; None:
        # the torch path).
        self.decode_kernel = None
        self.prefill_kernel = None
        # Called with (layer, that layer's cache) once a layer's new K / V are written, in
        # eager forwards that set it (the KV connector sends them while later layers run).
        self.on_layer_written: Callable[[int, torch.Tensor], None] | None = None
        # lm.batch_invariant on a GPU: every token, prefill and decode, through one kernel
        # (lm_worker/triton_invariant.py's `attention`; set by `use_invariant_kernels`).
        self.invariant_kernel = None

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        huge_pages: bool = False,
    ) -> None:
        """The cache, zeroed; `huge_pages` (CPU): on 2 MiB pages (lm_worker/huge_pages.py)."""
        shape = (num_layers, 2, num_blocks, self.block_size, num_kv_heads, head_dim)
        if huge_pages and device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            self.kv_cache = huge_pages_empty(nbytes).view(dtype).view(shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        # Per layer: its [2, ...] slice, and keys / values flattened to slots (views made once,
        # not four view ops per layer and step).
        self._layers = [
            (layer_kv, layer_kv[0].view(-1, num_kv_heads, head_dim),
             layer_kv[1].view(-1, num_kv_heads, head_dim))
            for layer_kv in self.kv_cache
        ]  # fmt: skip
        if device.type == "cuda":
            self.decode_kernel = _triton_kernel(self.block_size, "decode")
            if self.triton_prefill:
                self.prefill_kernel = _triton_kernel(self.block_size, "prefill")

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: PagedAttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        # layer_kv [2, num_blocks, block_size, kvh, d]; k_slots / v_slots [slots, kvh, d]
        layer_kv, k_slots, v_slots = self._layers[layer_idx]
        k_slots.index_copy_(0, meta.slot_mapping, k)
        v_slots.index_copy_(0, meta.slot_mapping, v)
        if self.on_layer_written is not None:
            self.on_layer_written(layer_idx, layer_kv)
        if self.invariant_kernel is not None:
            return self.invariant_kernel(
                q, layer_kv[0], layer_kv[1], meta, self.scale, sliding_window
            )

        parts = []
        num_decodes = meta.num_decodes
        if num_decodes:
            parts.append(self._decode(q[:num_decodes], layer_kv, meta, sliding_window, layer_idx))
        start = num_decodes
        if meta.prefill_query_lens and self.prefill_kernel is not None and q.is_cuda:
            # Every chunk in one launch over the paged cache, no mask materialised.
            if meta.prefill_plan is None:
                meta.prefill_plan = self.prefill_kernel.prefill_plan(
                    meta.prefill_query_lens,
                    meta.prefill_seq_lens,
                    meta.prefill_block_tables,
                    q.shape[1] // k.shape[1],
                    q.device,
                )
            end = start + meta.prefill_plan.num_tokens
            parts.append(
                self.prefill_kernel.paged_prefill(
                    q[start:end], layer_kv[0], layer_kv[1], meta.prefill_plan, self.scale,
                    sliding_window,
                )
            )  # fmt: skip
            start = end
        else:
            for n, seq_len, table in zip(
                meta.prefill_query_lens,
                meta.prefill_seq_lens,
                meta.prefill_block_tables,
                strict=True,
            ):
                parts.append(
                    self._prefill(
                        q[start : start + n],
                        k[start : start + n],
                        v[start : start + n],
                        layer_kv[0],
                        layer_kv[1],
                        seq_len,
                        table,
                        sliding_window,
                    )
                )
                start += n
        if start < q.shape[0]:  # padding past the real tokens (eager runs of padded batches)
            parts.append(torch.zeros_like(q[start:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self,
        q,
        layer_kv,  # [2, num_blocks, block_size, kvh, d]: this layer's keys and values
        meta: PagedAttentionMetadata,
        window: int | None,
        layer_idx: int,
    ) -> torch.Tensor:
        if self.decode_kernel is not None and q.is_cuda:
            return self.decode_kernel.paged_decode(
                q, layer_kv[0], layer_kv[1], meta.decode_block_tables, meta.decode_seq_lens,
                self.scale, window,
            )  # fmt: skip
        # Every sequence's whole block table is gathered (under graphs: max_model_len keys),
        # keys and values in one index_select (a few times faster than advanced indexing).
        D, _, head_dim = q.shape
        tables = meta.decode_block_tables  # [D, M]
        L = tables.shape[1] * self.block_size
        kv = layer_kv.index_select(1, tables.reshape(-1))  # [2, D * M, block_size, kvh, d]
        kv = kv.view(2, D, L, -1, head_dim).transpose(2, 3)  # [2, D, kvh, L, d]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [D, H, 1, d]
            kv[0],
            kv[1],
            attn_mask=self._decode_mask(layer_idx, meta, L, window, q),
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _decode_mask(
        layer_idx: int, meta: PagedAttentionMetadata, L: int, window: int | None, q: torch.Tensor
    ) -> torch.Tensor:  # [D, 1, 1, L] of q's dtype: 0 on the keys each sequence sees, else -inf
        """Made by the first layer of a forward and reused by the others (every layer of a
        step sees the same keys); tensor ops only, so it is captured with the graph. Additive,
        not bool: attention turns a bool mask into this in every call (two operations a layer,
        about 3% of a CPU decode step of the bench's model)."""
        masks = meta.decode_masks
        if layer_idx == 0:
            masks.clear()
        mask = masks.get(window)
        if mask is None or mask.shape[-1] != L:
            index = torch.arange(L, device=q.device)
            valid = index < meta.decode_seq_lens[:, None]  # [D, L]
            if window is not None:  # only the last `window` keys
                valid &= index >= meta.decode_seq_lens[:, None] - window
            mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device)
            mask = masks[window] = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
        return mask

    def _prefill(
        self, q, k, v, k_cache, v_cache, seq_len: int, table, window: int | None
    ) -> torch.Tensor:
        n = q.shape[0]
        if window is not None and window < seq_len:
            head_dim = q.shape[2]
            start = max(0, seq_len - n - window + 1)  # the first key any query can see
            if seq_len == n:
                keys, values = k, v
            else:
                keys = k_cache[table].view(-1, k.shape[1], head_dim)[:seq_len]
                values = v_cache[table].view(-1, v.shape[1], head_dim)[:seq_len]
            keys, values = keys[start:], values[start:]
            qpos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
            kpos = torch.arange(start, seq_len, device=q.device)[None, :]
            mask = (kpos <= qpos) & (qpos - kpos < window)
            return _sdpa(q, keys, values, mask, False, self.scale)
        if seq_len == n:  # nothing cached before this chunk: attend to the chunk itself
            keys, values, mask, causal = k, v, None, True
        else:
            head_dim = q.shape[2]
            keys = k_cache[table].view(-1, k.shape[1], head_dim)[:seq_len]
            values = v_cache[table].view(-1, v.shape[1], head_dim)[:seq_len]
            # Query i (the (seq_len - n + i)-th token) sees keys 0 .. seq_len - n + i.
            mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
            causal = False
        return _sdpa(q, keys, values, mask, causal, self.scale)


def _sdpa(q, keys, values, mask, causal: bool, scale: float) -> torch.Tensor:
    """One sequence's attention, [n, heads, head_dim] in and out, through SDPA on 4-D tensors:
    given 3-D ones, torch 2.13 on a CPU runs its math kernel (the [heads, n, seq_len] scores
    materialised: 8x slower at 2048 tokens) where 4-D ones get the flash kernel."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _triton_kernel(block_size: int, what: str):
    """lm_worker/triton_{what}.py (the GPU's decode or prefill attention), or None (logged)
    where it cannot run: Triton missing, or a block size that is not a power of two."""
    if block_size & (block_size - 1):
        logger.warning(
            "block_size %d is not a power of two: %s attention in torch", block_size, what
        )
        return None
    try:
        return importlib.import_module(f"lm_worker.triton_{what}")
    except ImportError as e:
        logger.warning("Triton is not available (%s): %s attention in torch", e, what)
        return None
