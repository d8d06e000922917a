"""Paged decode attention in Triton (CUDA only: imported only when the KV cache is on a GPU).

One program per (sequence, query head) walks the sequence's own blocks through its block table,
from the first one inside the sliding window to the one holding its last token, with an online
softmax in float32: it reads the blocks the sequence uses and nothing else, whatever the width
of the block table. The loop bounds come from `seq_lens` in device memory, so a CUDA graph
captured once replays correctly over any lengths later steps write there (the torch path instead
gathers every sequence's full table, `max_model_len` keys, under graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    scale,
    window,  # 0: no sliding window
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,  # cache [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    stride_ct,
    stride_ch,
    stride_ts,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK: tl.constexpr,  # the cache's block size (a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + s * stride_qs + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    t = tl.arange(0, BLOCK)
    m_i = -1.0e30  # finite: a fully masked block then adds exp(-inf) = 0, never NaN
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for b in range(start // BLOCK, tl.cdiv(seq_len, BLOCK)):
        block_id = tl.load(tables_ptr + s * stride_ts + b).to(tl.int64)
        pos = b * BLOCK + t
        ok = (pos >= start) & (pos < seq_len)
        offsets = block_id * stride_cb + t[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(
        out_ptr + s * stride_os + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def paged_decode(
    q: torch.Tensor,  # [D, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [D, max_blocks] (only the used prefix of each row is read)
    seq_lens: torch.Tensor,  # [D], tokens including the new one (>= 1)
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [D, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    assert num_heads % num_kv_heads == 0
    out = torch.empty_like(q)
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_decode_kernel[(num_seqs, num_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


__all__ = ["paged_decode"]
