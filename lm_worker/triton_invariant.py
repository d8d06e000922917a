"""Batch-invariant kernels in Triton: the GPU side of `lm.batch_invariant` (the CPU side is our
C layers, lm_worker/cpu_decode.py's `InvariantForward`).

A request's logits stay the same whatever else is in its batch when no sum a token takes
depends on the other tokens of the step. On a GPU three kinds of kernel break that, and each
is replaced here (elementwise kernels compute each value alone and are left as they are):

- matrix products: cuBLAS picks its tiling, split-K and algorithm by the number of rows, so a
  row's sums change order with the batch. `matmul` runs one fixed tiling for every shape (no
  split-K, tiles of BLOCK_M rows whatever the rows): a row's output is its own dot products,
  accumulated over K in the same BLOCK_K steps each time.
- reductions over a row (RMSNorm): torch's reduction kernels pick their layout by shape too.
  `rms_norm` is one program per row, the same layout for every row.
- attention: flash-decoding splits a sequence's keys by how many sequences the step has, and
  prefill and decode are different kernels. `attention` is one kernel for prefill and decode
  tokens alike: a program per (tile of up to QUERY_TILE query tokens of one sequence, query
  head), each query walking the keys in TILE-wide tiles at fixed positions (0, TILE, ...) with
  an online softmax. A tile a query must not see is masked whole, and such a tile changes
  nothing (weights exp(-inf) = 0, rescale exp(0) = 1), so a token's result is the same whether
  it is a decode, the 1st or the 16th query of a prefill tile, and however the prompt was
  chunked.

`use_invariant_kernels` switches a loaded model and its attention to them. Decode steps stay
capturable in CUDA graphs: shapes fixed by the step's padded size, lengths read on the device.
Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors:
tests/test_triton_interpreter.py holds their invariance there on every CI run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import nn

from lm_worker.attention import PagedAttention, PagedAttentionMetadata
from lm_worker.triton_decode import paged_offsets
from models.layers import RMSNorm

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # one tiling for every product
QUERY_TILE = 16  # query tokens a program (tl.dot's fewest rows)
TILE = 64  # keys an attention program reads per iteration
# The interpreter computes bf16 and fp16 products wrongly (see triton_decode.py): there the
# kernels cast to float32 first, and multiply tiles as a sum of products (`_mm`): its tl.dot is
# NumPy's, whose BLAS sums a row in an order that depends on the row's place in the tile, where
# a GPU's tensor cores sum every output the same way. The kernels' logic (fixed tiles, masks,
# the online softmax) is what the interpreter checks; the GPU checks hold the hardware's sums.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """a [m, k] @ b [k, n] in float32."""
    if INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _matmul_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]: an nn.Linear's weight
    b_ptr,  # [N] or nothing (HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + k[None, :],
            mask=(cols[:, None] < N) & (k[None, :] < K),
            other=0.0,
        )
        acc += _mm(x, tl.trans(w), PRECISION, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias): F.linear with one tiling for every M."""
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1 and x.dtype == weight.dtype
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](
        y,
        x,
        weight,
        bias if bias is not None else y,  # (not read without a bias)
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION=_precision(x.dtype),
        INTERPRETED=_INTERPRETED,
        num_warps=4,
        num_stages=2,
    )
    return y


@triton.jit
def _rms_norm_kernel(y_ptr, x_ptr, w_ptr, n, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    # As models/layers.py's RMSNorm: normalised in float32, cast back, then scaled.
    normed = (x * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + i, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., n], one program a row."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty_like(rows)
    n = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](
        y, rows, weight, n, eps, rows.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(n)
    )
    return y.view(x.shape)


@triton.jit
def _attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    q_ptr,  # [T, num_heads, head_dim]
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    v_ptr,
    tables_ptr,  # [sequences, max_blocks]
    tile_row_ptr,  # per query tile: its sequence's row of the tables
    tile_first_ptr,  # the tile's first query token (its row of q)
    tile_len_ptr,  # keys the first query sees (itself included)
    tile_count_ptr,  # query tokens in the tile (1 .. QUERY_TILE)
    scale,
    window,  # 0: no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_ts,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK: tl.constexpr,  # the cache's block size (a power of two)
    QUERY_TILE: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq = tl.load(tile_row_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    len0 = tl.load(tile_len_ptr + tile).to(tl.int32)
    count = tl.load(tile_count_ptr + tile).to(tl.int32)

    r = tl.arange(0, QUERY_TILE)
    r_ok = r < count
    lens = len0 + r  # keys each query sees
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (first + r)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    hi = len0 + count - 1  # keys the tile's last query sees
    lo = tl.where(window > 0, tl.maximum(len0 - window, 0), 0)  # the first any query sees
    t = tl.arange(0, TILE)
    m_i = tl.full((QUERY_TILE,), -1.0e30, tl.float32)
    l_i = tl.zeros((QUERY_TILE,), tl.float32)
    acc = tl.zeros((QUERY_TILE, BLOCK_D), tl.float32)
    for key0 in range(lo - lo % TILE, hi, TILE):  # tiles at fixed positions: 0, TILE, ...
        pos = key0 + t
        key_ok = pos < hi
        row = tables_ptr + seq * stride_ts
        offsets = paged_offsets(
            row, pos, key_ok, kv_head, d, stride_cb, stride_ct, stride_ch, BLOCK
        )
        mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
        scores = _mm(q, tl.trans(k), PRECISION, INTERPRETED)
        seen = pos[None, :] < lens[:, None]
        seen &= (window == 0) | (pos[None, :] >= lens[:, None] - window)
        scores = tl.where(seen, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PRECISION, INTERPRETED)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (first + r)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


def query_tiles(meta: PagedAttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tables, tile_row, tile_first, tile_len, tile_count) of a step: a tile per decode
    (lengths read on the device, so a graph replays them), then each prefill chunk cut into
    tiles of QUERY_TILE tokens (eager steps only)."""
    D = meta.num_decodes
    decodes = torch.arange(D, device=device)
    if not meta.prefill_query_lens:
        ones = torch.ones(D, dtype=torch.long, device=device)
        return meta.decode_block_tables, decodes, decodes, meta.decode_seq_lens, ones
    widths = [t.numel() for t in meta.prefill_block_tables]
    width = max(meta.decode_block_tables.shape[1], *widths)
    tables = torch.zeros(D + len(meta.prefill_query_lens), width, dtype=torch.long, device=device)
    tables[:D, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    rows, firsts, lens, counts = [], [], [], []
    start = D
    for i, (n, seq_len, table) in enumerate(
        zip(meta.prefill_query_lens, meta.prefill_seq_lens, meta.prefill_block_tables, strict=True)
    ):
        tables[D + i, : table.numel()] = table
        for k in range(0, n, QUERY_TILE):
            rows.append(D + i)
            firsts.append(start + k)
            lens.append(seq_len - n + k + 1)
            counts.append(min(QUERY_TILE, n - k))
        start += n
    prefill = torch.tensor([rows, firsts, lens, counts], dtype=torch.long).to(device)
    return (
        tables,
        torch.cat([decodes, prefill[0]]),
        torch.cat([decodes, prefill[1]]),
        torch.cat([meta.decode_seq_lens[:D], prefill[2]]),
        torch.cat([torch.ones(D, dtype=torch.long, device=device), prefill[3]]),
    )


def attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Every token of the step (its K / V already in the cache) over the keys it sees."""
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    if q.stride(2) != 1:
        q = q.contiguous()
    tiles = meta.invariant_tiles
    if tiles is None:  # once a forward: every layer reads the same
        tiles = meta.invariant_tiles = query_tiles(meta, q.device)
    tables, tile_row, tile_first, tile_len, tile_count = tiles
    out = torch.zeros_like(q)  # padded tokens past the tiles stay zero
    _attention_kernel[(tile_row.shape[0], num_heads)](
        out,
        q,
        k_cache,
        v_cache,
        tables,
        tile_row,
        tile_first,
        tile_len,
        tile_count,
        scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK=block_size,
        QUERY_TILE=QUERY_TILE,
        TILE=TILE,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION=_precision(q.dtype),
        INTERPRETED=_INTERPRETED,
        num_warps=4,
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    """float32 products in IEEE float32 (not TF32, as torch's default); bf16 ignores it."""
    return "ieee" if dtype == torch.float32 or _INTERPRETED else "tf32"


class InvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return matmul(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


class InvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def use_invariant_kernels(model: nn.Module, attention_backend: PagedAttention) -> int:
    """Switch the model's linear layers and RMSNorms and its attention to this file's kernels
    (inference only); returns how many modules were switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not None:
            module.__class__ = InvariantLinear
            switched += 1
        elif type(module) is RMSNorm:
            module.__class__ = InvariantRMSNorm
            switched += 1
    attention_backend.invariant_kernel = attention
    return switched
