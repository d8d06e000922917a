"""Paged decode attention in Triton (CUDA only: imported only when the KV cache is on a GPU).

Flash-decoding over the paged cache, in two kernels:

1. `_split_kernel`, one program per (sequence, KV head, split of the sequence): the query
   heads that share the KV head (GQA) attend together, so each key and value is read once, not
   once per query head; the program walks its split's tokens TILE at a time (each token's block
   looked up in the block table), with an online softmax in float32, and writes its partial
   result (the unnormalised sum, the running max and the sum of weights).
2. `_combine_kernel`, one program per (sequence, query head): merges the splits' partials.

Splits are what keep a GPU busy at a few sequences: 8 sequences x 4 KV heads are 32 programs,
a quarter of an H100's multiprocessors; cut into splits they are hundreds. A program reads only
the tokens from the first one inside the sliding window to the sequence's last: splits past a
sequence's end, or before its window, write an empty partial and stop. The loop bounds come from
`seq_lens` in device memory and the number of splits from the block table's width alone, so a
CUDA graph captured once replays correctly over any lengths later steps write there (the torch
path instead gathers every sequence's full table, `max_model_len` keys, under graphs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

TILE = 64  # tokens a split program reads per iteration
TARGET_PROGRAMS = 4  # split programs per multiprocessor, at least (where the table is wide)
NUM_WARPS = 4  # per split program (Triton's default)
# Triton's interpreter (TRITON_INTERPRET=1: the kernel on CPU tensors, tests/
# test_triton_interpreter.py) computes bf16 and fp16 products wrongly (Triton 3.9: errors of
# 1e10 on a 16 x 16 product): there the kernel casts keys, values and queries to float32
# first. A GPU multiplies them as they are (tests/test_lm_cuda.py holds that to the torch path).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def paged_offsets(
    table_ptr, pos, ok, kv_head, d, stride_cb, stride_ct, stride_ch, BLOCK: tl.constexpr
):
    """The paged cache's layout, for every kernel that reads it: element offsets into a cache
    [blocks, block_size, kv_heads, head_dim] of key positions `pos` (read where `ok`) of the
    sequence whose block-table row starts at `table_ptr`, KV head `kv_head`, dims `d`."""
    block_id = tl.load(table_ptr + pos // BLOCK, mask=ok, other=0)
    return (
        block_id.to(tl.int64)[:, None] * stride_cb
        + (pos % BLOCK)[:, None] * stride_ct
        + kv_head * stride_ch
        + d[None, :]
    )


@triton.jit
def _split_kernel(
    part_acc_ptr,  # [S, H, SPLITS, HEAD_DIM] float32
    part_ml_ptr,  # [S, H, SPLITS, 2] float32: running max, sum of weights
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    scale,
    window,  # 0: no sliding window
    num_heads,
    splits,
    split_tokens,  # tokens per split (a multiple of TILE)
    stride_qs,
    stride_qh,
    stride_cb,  # cache [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    stride_ct,
    stride_ch,
    stride_ts,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (tl.dot's rows)
    BLOCK: tl.constexpr,  # the cache's block size (a power of two)
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    PRECISION: tl.constexpr,  # "ieee" for float32 (not TF32); bf16 and fp16 ignore it
    UPCAST: tl.constexpr,  # products in float32 whatever the cache's dtype (the interpreter)
):
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    j = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    lo = tl.maximum(j * split_tokens, start)
    hi = tl.minimum((j + 1) * split_tokens, seq_len)

    g = tl.arange(0, GROUP_P)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    t = tl.arange(0, TILE)
    m_i = tl.full((GROUP_P,), -1.0e30, tl.float32)  # finite: masked tokens add exp(-inf) = 0
    l_i = tl.zeros((GROUP_P,), tl.float32)
    acc = tl.zeros((GROUP_P, BLOCK_D), tl.float32)
    for first in range(lo - lo % TILE, hi, TILE):
        pos = first + t
        ok = (pos >= lo) & (pos < hi)
        row = tables_ptr + s * stride_ts
        offsets = paged_offsets(row, pos, ok, kv_head, d, stride_cb, stride_ct, stride_ch, BLOCK)
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    row = (s * num_heads + heads) * splits + j  # [GROUP_P]
    tl.store(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        acc,
        mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    splits,
    stride_os,
    stride_oh,
    SPLITS_P: tl.constexpr,  # splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, SPLITS_P)
    j_ok = j < splits
    row = (s * num_heads + h) * splits + j
    m = tl.load(part_ml_ptr + row * 2, mask=j_ok, other=-1.0e30)
    weights = tl.load(part_ml_ptr + row * 2 + 1, mask=j_ok, other=0.0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=j_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # An empty split (m = -1e30, l = 0, acc = 0) weighs exp(-1e30 - m_max) = 0.
    w = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(weights * w, axis=0)
    tl.store(
        out_ptr + s * stride_os + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter on CPU tensors: a few splits, to exercise them
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(num_programs: int, table_tokens: int, multiprocessors: int) -> tuple[int, int]:
    """(splits, tokens per split) for `num_programs` (sequence, KV head) pairs over block
    tables `table_tokens` wide: enough splits for TARGET_PROGRAMS programs a multiprocessor,
    none shorter than a TILE. From shapes alone, so a captured graph keeps it."""
    wanted = -(-TARGET_PROGRAMS * multiprocessors // num_programs)
    splits = max(1, min(wanted, -(-table_tokens // TILE)))
    split_tokens = -(-table_tokens // splits)
    split_tokens = -(-split_tokens // TILE) * TILE
    return -(-table_tokens // split_tokens), split_tokens


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
    assert num_heads % num_kv_heads == 0 and q.dtype == k_cache.dtype
    group = num_heads // num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    splits, split_tokens = split_plan(
        num_seqs * num_kv_heads, block_tables.shape[1] * block_size, _multiprocessors(q.device)
    )
    part_acc = torch.empty(num_seqs, num_heads, splits, head_dim, device=q.device)
    part_ml = torch.empty(num_seqs, num_heads, splits, 2, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _split_kernel[(num_seqs, num_kv_heads, splits)](
        part_acc,
        part_ml,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        window or 0,
        num_heads,
        splits,
        split_tokens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK=block_size,
        TILE=TILE,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST=_INTERPRETED,
        num_warps=NUM_WARPS,
    )
    out = torch.empty_like(q)
    _combine_kernel[(num_seqs, num_heads)](
        out,
        part_acc,
        part_ml,
        num_heads,
        splits,
        out.stride(0),
        out.stride(1),
        SPLITS_P=triton.next_power_of_2(splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
    )
    return out


__all__ = ["paged_decode", "split_plan"]
