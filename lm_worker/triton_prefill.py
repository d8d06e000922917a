"""Paged prefill attention in Triton (CUDA only: imported only when the KV cache is on a GPU).

Every prefill chunk of a step in one launch, reading keys and values from the paged cache
(the chunk's own were written there first), with no mask materialised:

- one program per (query tile, KV head): TQ query tokens of one chunk and the GROUP query
  heads that share the KV head (GQA) form the tile's rows, so each key and value is read once
  for all of them (rows are token-major: row r is token r // GROUP_P, head r % GROUP_P);
- a query at sequence position p sees keys 0 .. p (causal over the cached prefix plus the
  chunk), and with a sliding window only those after p - window; a program walks the key
  tiles from the first any of its queries sees to its last query's position, each key's block
  looked up in the chunk's block table, with an online softmax in float32;
- chunks of any lengths (variable-length sequences, chunked prefill, prefix-cache hits: a
  chunk's cached prefix is its `seq_len - query_len` first keys).

The torch path (lm_worker/attention.py's `_prefill`) stays the CPU's and the reference:
tests/test_triton_interpreter.py holds this kernel to it under Triton's interpreter in every
test run (lengths, prefixes, windows, GQA ratios, head sizes 64 / 80 / 128, fp32 and bf16), and
tests/test_lm_cuda.py on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lm_worker.triton_decode import paged_offsets

TK = 32  # keys per iteration
# See lm_worker/triton_decode.py: the interpreter's bf16 / fp16 products are wrong (Triton
# 3.9), so there the kernel computes in float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    q_ptr,  # [T, num_heads, head_dim]: the step's prefill tokens, chunk after chunk
    k_ptr,  # cache [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    v_ptr,
    tables_ptr,  # [chunks, max_blocks]
    q_starts_ptr,  # [chunks + 1]: each chunk's first token in q
    seq_lens_ptr,  # [chunks]: cached prefix + the chunk
    tile_chunk_ptr,  # [tiles]: the chunk a tile belongs to
    tile_first_ptr,  # [tiles]: its first query token, within the chunk
    scale,
    window,  # 0: no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_tc,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    TQ: tl.constexpr,  # query tokens per tile (rows = TQ * GROUP_P >= 16)
    TK: tl.constexpr,
    BLOCK: tl.constexpr,  # the cache's block size (a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    c = tl.load(tile_chunk_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    q_lo = tl.load(q_starts_ptr + c)
    n = tl.load(q_starts_ptr + c + 1) - q_lo
    prefix = tl.load(seq_lens_ptr + c) - n

    r = tl.arange(0, TQ * GROUP_P)
    t = first + r // GROUP_P  # the row's query token, within the chunk
    g = r % GROUP_P
    row_ok = (t < n) & (g < GROUP)
    head = kv_head * GROUP + g
    qpos = prefix + t  # its sequence position: it sees keys <= qpos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_lo + t).to(tl.int64)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((TQ * GROUP_P,), -1.0e30, tl.float32)  # finite: masked keys add exp(-inf) = 0
    l_i = tl.zeros((TQ * GROUP_P,), tl.float32)
    acc = tl.zeros((TQ * GROUP_P, BLOCK_D), tl.float32)
    last = prefix + tl.minimum(first + TQ, n)  # keys before it: the tile's last query's
    lo = tl.where(window > 0, tl.maximum(prefix + first - window + 1, 0), 0)
    kk = tl.arange(0, TK)
    for k0 in range(lo - lo % TK, last, TK):
        pos = k0 + kk
        k_ok = (pos >= lo) & (pos < last)
        row = tables_ptr + c * stride_tc
        offsets = paged_offsets(row, pos, k_ok, kv_head, d, stride_cb, stride_ct, stride_ch, BLOCK)
        mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = k_ok[None, :] & (pos[None, :] <= qpos[:, None])
        seen &= (window == 0) | (qpos[:, None] - pos[None, :] < window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows saw nothing
    tl.store(
        out_ptr
        + (q_lo + t).to(tl.int64)[:, None] * stride_ot
        + head[:, None] * stride_oh
        + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@dataclass(frozen=True)
class PrefillPlan:
    """A step's prefill chunks as the kernel reads them, made once for all its layers."""

    tables: torch.Tensor  # [chunks, max_blocks] int64
    starts: torch.Tensor  # [chunks + 1]: each chunk's first token
    seq_lens: torch.Tensor  # [chunks]
    tile_chunk: torch.Tensor  # [tiles]
    tile_first: torch.Tensor  # [tiles]
    num_tokens: int
    tq: int  # query tokens per tile


def prefill_plan(
    query_lens: list[int],  # per chunk
    seq_lens: list[int],  # per chunk: its cached prefix + the chunk
    block_tables: list[torch.Tensor],  # per chunk, its blocks (covering seq_len)
    group: int,  # query heads per KV head
    device: torch.device,
) -> PrefillPlan:
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    tq = max(16, 64 // triton.next_power_of_2(group))
    chunks, first = [], []
    for c, n in enumerate(query_lens):
        for start in range(0, n, tq):
            chunks.append(c)
            first.append(start)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(len(block_tables), width, dtype=torch.int64, device=device)
    for c, table in enumerate(block_tables):
        tables[c, : len(table)] = table
    return PrefillPlan(
        tables,
        torch.tensor([0, *query_lens], device=device).cumsum(0),
        torch.tensor(seq_lens, device=device),
        torch.tensor(chunks, device=device),
        torch.tensor(first, device=device),
        sum(query_lens),
        tq,
    )


def paged_prefill(
    q: torch.Tensor,  # [T, num_heads, head_dim]: the prefill chunks' tokens, in order
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    assert num_heads % num_kv_heads == 0 and q.dtype == k_cache.dtype
    assert plan.num_tokens == num_tokens
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _prefill_kernel[(len(plan.tile_chunk), num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        plan.tables,
        plan.starts,
        plan.seq_lens,
        plan.tile_chunk,
        plan.tile_first,
        scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        plan.tables.stride(0),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        TQ=plan.tq,
        TK=TK,
        BLOCK=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST=_INTERPRETED,
    )
    return out


__all__ = ["PrefillPlan", "paged_prefill", "prefill_plan"]
