"""A CPU decode step of a few sequences through every decoder layer in one C call (cpu_decode.c).

On a CPU a batch-1 decode step is bound by streaming the weights, and our gemv streams them at
about a sum's rate; what is left is dispatch: each layer is some 30 torch operators (norms,
rotary, the KV write, attention, SiLU, residual adds) of a few microseconds each, about a
quarter of a step of the bench's model, and each step's first operators run from caches the
weights' stream has just emptied. `FusedDecode` runs the same operations in C, on the
model's own weights and the engine's paged KV cache, for decode steps of one to eight
sequences; its products read each weight row once for all of them, so two sequences cost
about what one does (torch's batch kernels read a few rows at half that rate or less). Every
other step (prefill, larger batches) runs the torch modules as before.

It serves any model that describes its decoder (`decoder_weights()`, models/layers.py's
`DecoderWeights`: pre-norm layers with merged q / k / v and gate / up, rotary over up to three
position axes), in float32 or bfloat16 (computing in float32 and rounding where torch's bf16
tensors round), and is kept for the sequence counts where it is measured faster than the
modules at start-up (`choose_fused_decode`). The model runner holds it and calls one entry
point, `step` (token ids to logits), before the modules.

`InvariantForward` runs the same C layers for every step of a worker with `lm.batch_invariant`
on, prefill included, each token's arithmetic its own (see there).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lm_worker.attention import PagedAttention, PagedAttentionMetadata
from lm_worker.cpu_kernels import (
    c_library,
    cached_choice,
    choice_key,
    linear_layers,
    remember_choice,
)
from models.layers import DecoderWeights


class _Layer(ctypes.Structure):  # struct epd_layer
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "norm1", "qkv_w", "qkv_b", "o_w", "norm2", "gate_up_w", "down_w", "k_cache", "v_cache",
            "q_norm", "k_norm", "router_w", "experts_gate_up", "experts_down",
        )
    ]  # fmt: skip


class _Decoder(ctypes.Structure):  # struct epd_decoder
    _fields_ = [
        *((name, ctypes.c_long) for name in (
            "num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size"
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p),
        ("inv_freq", ctypes.c_void_p),
        ("freq_axis", ctypes.c_void_p),
        ("bf16", ctypes.c_long),
        ("embed", ctypes.c_void_p),
        ("head", ctypes.c_void_p),
        ("vocab", ctypes.c_long),
        *((name, ctypes.c_long) for name in (
            "num_experts", "top_k", "moe_intermediate", "norm_topk"
        )),
        ("all_reduce", ctypes.c_void_p),  # void (*)(float *, long), or NULL
    ]  # fmt: skip


_AllReduce = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_long)


def _all_reduce_callback(tp) -> _AllReduce:
    """The C layers' all-reduce (a sharded model's, models/parallel.py): the floats at the
    pointer, added over the ranks in place."""

    def call(pointer, n: int) -> None:
        tp.all_reduce(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(n,))))

    return _AllReduce(call)


class _Seqs(ctypes.Structure):  # struct epd_seqs
    _fields_ = [
        ("S", ctypes.c_long),
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_long),
        ("max_blocks", ctypes.c_long),
        ("lens", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("position_stride", ctypes.c_long),
        ("rows", ctypes.c_void_p),  # NULL: token s is sequence s's
    ]


MAX_SEQS = 8  # cpu_decode.c's MAX_SEQS


class FusedDecode:
    """A decode step of 1 .. `max_seqs` sequences (one new token each) through the model's
    decoder layers and final norm in C, and (`whole_step`) its embedding and LM head too.
    `step(ids, positions, attn_metadata)` gives the step's logits, or None for a step it does
    not take (prefill, more sequences): the runner then runs the modules."""

    def __init__(self, model: nn.Module, attention: PagedAttention, max_seqs: int = MAX_SEQS):
        w = _described(model, attention)
        if isinstance(w, str):
            raise ValueError(f"no fused decode: {w}")
        if not 1 <= max_seqs <= MAX_SEQS:
            raise ValueError(f"max_seqs must be 1 .. {MAX_SEQS}, got {max_seqs}")
        self.model = model
        self.attention = attention
        self.max_seqs = max_seqs
        lib = c_library()[0]
        self._run, self._run_step = lib.epd_decode_layers, lib.epd_decode_step
        cache = attention.kv_cache
        layers = [
            _Layer(
                *(t.data_ptr() if t is not None else None for t in (
                    layer.norm1, layer.qkv, layer.qkv_bias, layer.o, layer.norm2, layer.gate_up,
                    layer.down, cache[i, 0], cache[i, 1], layer.q_norm, layer.k_norm,
                    layer.router, layer.experts_gate_up, layer.experts_down,
                ))
            )
            for i, layer in enumerate(w.layers)
        ]  # fmt: skip
        self._layers = (_Layer * len(layers))(*layers)
        self._inv_freq = w.inv_freq.float().contiguous()
        self._freq_axis = torch.tensor(w.freq_axis, dtype=torch.int32)
        dtype = w.final_norm.dtype
        ends = (w.embed, w.head)
        tp = getattr(model, "tensor_parallel", None)
        # Tensor parallelism: the C layers add the ranks' sums through Python's group, and
        # the vocabulary-parallel ends stay the model's (their own collectives).
        self._all_reduce = _all_reduce_callback(tp) if tp is not None else None
        # A whole step (`logits`) where both ends are there as the layers' weights are.
        self.whole_step = (
            tp is None
            and all(
                t is not None and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
                for t in ends
            )
            and w.embed.shape == w.head.shape
        )
        if not self.whole_step:
            ends = (None, None)
        self._decoder = _Decoder(
            len(w.layers),
            w.final_norm.shape[0],
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            w.intermediate_size,
            attention.block_size,
            w.eps,
            attention.scale,
            self._layers,
            w.final_norm.data_ptr(),
            self._inv_freq.data_ptr(),
            self._freq_axis.data_ptr(),
            dtype == torch.bfloat16,
            *(t.data_ptr() if t is not None else None for t in ends),
            w.head.shape[0] if self.whole_step else 0,
            w.num_experts,
            w.top_k,
            w.moe_intermediate,
            w.norm_topk,
            ctypes.cast(self._all_reduce, ctypes.c_void_p) if self._all_reduce else None,
        )
        # The pointers above are into these tensors: they live as long as this object.
        self._tensors = [w, cache, self._inv_freq, self._freq_axis]

    def step(
        self,
        ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [axes, T] or [T]
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor | None:  # [T, vocab]
        """A decode step's logits: in one C call where the model offers both ends
        (`whole_step`), else the model's embedding and head around the C layers. None for a
        step it does not take."""
        if self.whole_step:
            return self.logits(ids, positions, meta)
        if not self._takes(ids.shape[0], meta):
            return None
        hidden = self._run_layers(self.model.embed_input_ids(ids), positions, meta)
        return self.model.compute_logits(hidden)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [axes, T] or [T]
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor | None:  # [T, hidden]
        """The layers and final norm alone, from the embeddings (None for a step it does not
        take)."""
        if not self._takes(x.shape[0], meta):
            return None
        return self._run_layers(x, positions, meta)

    def _run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        threads = torch.get_num_threads()
        self._check(self._run(*self._seqs(positions, meta), x.data_ptr(), out.data_ptr(), threads))
        return out

    def logits(
        self,
        ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [axes, T] or [T]
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor | None:
        """A whole decode step in the one C call, token ids to logits ([T, vocab]): the
        embedding lookup and the LM head besides the layers, where the model offers both
        (`whole_step`). Each torch call it saves costs tens of microseconds in a decode step,
        which runs with caches the weights' stream has emptied. None for a step it does not
        take, or without both ends."""
        if not self.whole_step or not self._takes(ids.shape[0], meta):
            return None
        assert ids.dtype == torch.int64 and ids.is_contiguous()
        dtype = torch.bfloat16 if self._decoder.bf16 else torch.float32
        out = torch.empty(ids.shape[0], self._decoder.vocab, dtype=dtype)
        threads = torch.get_num_threads()
        self._check(
            self._run_step(*self._seqs(positions, meta), ids.data_ptr(), out.data_ptr(), threads)
        )
        return out

    def _takes(self, S: int, meta: PagedAttentionMetadata) -> bool:
        return (
            1 <= S <= self.max_seqs
            and meta.num_decodes == S
            and not meta.prefill_query_lens
            and self.attention.on_layer_written is None  # the KV connector's per-layer save
        )

    def _seqs(self, positions: torch.Tensor, meta: PagedAttentionMetadata) -> tuple:
        """The C call's first arguments: the decoder, the step's sequences."""
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables.stride(1) == 1 and lens.is_contiguous() and positions.stride(-1) == 1
        seqs = _Seqs(
            meta.num_decodes,
            tables.data_ptr(),
            tables.stride(0),
            tables.shape[1],
            lens.data_ptr(),
            positions.data_ptr(),
            positions.stride(0) if positions.dim() == 2 else 0,  # [T]: one axis for all
            None,
        )
        return ctypes.byref(self._decoder), ctypes.byref(seqs)  # (byref keeps seqs alive)

    def _check(self, failed: int) -> None:
        if failed == -1:
            raise MemoryError("fused decode: no memory for its scratch")
        if failed == -4:
            raise ValueError(
                f"fused decode: a token id outside the vocabulary of {self._decoder.vocab}"
            )
        if failed:
            raise RuntimeError("fused decode: a sequence's length does not fit its block table")


class InvariantForward:
    """The batch-invariant forward (`lm.batch_invariant`): every step, prefill and decode tokens
    alike, from the embeddings through the C layers to the logits of the sampled tokens, with
    each token's arithmetic its own. Its products are the one-row product's sums for every
    token (cpu_decode.c's `products_each`), its attention runs over exactly the keys the token
    sees, in order, and norms, rotary and SiLU go token by token. So a request's logits do not
    depend on what else is in its batch, on how its prompt was cut into chunks, or on which
    earlier request computed its cached prefix: the same request gives the same tokens alone,
    in any batch, after a preemption and on another worker of the same build and CPU.

    The cost is the batch kernels' speed: each token's products read the weights from cache
    one row at a time, where a batch kernel shares its loads among rows (`epd bench lm
    --batch-invariant` measures it)."""

    # Tokens a C call: bounds its scratch (some 4 x (2 hidden + 3 intermediate) bytes a token).
    GROUP = 256

    def __init__(self, model: nn.Module, attention: PagedAttention):
        self.decoder = FusedDecode(model, attention)  # the decoder as the C reads it
        if not self.decoder.whole_step:
            raise ValueError(
                "no batch-invariant forward: the model's LM head is not a dense CPU tensor of "
                "its layers' dtype"
            )
        self._run = c_library()[0].epd_forward_tokens
        self.vocab = self.decoder._decoder.vocab
        self.dtype = torch.bfloat16 if self.decoder._decoder.bf16 else torch.float32

    def logits(
        self,
        embeds: torch.Tensor,  # [T, hidden], the step's tokens in order
        positions: torch.Tensor,  # [axes, T] or [T]
        block_ids: list[list[int]],  # each request's block table
        computed: np.ndarray,  # [requests] tokens each has in the cache before this step
        counts: np.ndarray,  # [requests] tokens each has in this step
        sample: np.ndarray,  # token indices whose logits are wanted, ascending
    ) -> torch.Tensor:  # [len(sample), vocab]
        T = embeds.shape[0]
        width = max(len(row) for row in block_ids)
        tables = np.zeros((len(block_ids), width), dtype=np.int64)  # 0: the null block
        for i, row in enumerate(block_ids):
            tables[i, : len(row)] = row
        rows = np.repeat(np.arange(len(block_ids), dtype=np.int64), counts)
        starts = np.cumsum(counts) - counts
        # Keys token t sees: its sequence's cached ones, then the step's up to itself.
        lens = computed[rows] + np.arange(T, dtype=np.int64) - starts[rows] + 1
        sample = np.ascontiguousarray(sample, dtype=np.int64)
        out = torch.empty(len(sample), self.vocab, dtype=self.dtype)
        embeds = embeds.contiguous()
        assert embeds.dtype == self.dtype and positions.stride(-1) == 1
        threads = torch.get_num_threads()
        done = 0  # sampled rows written
        for g0 in range(0, T, self.GROUP):
            g1 = min(g0 + self.GROUP, T)
            k1 = done + int(np.searchsorted(sample[done:], g1))
            group_sample = sample[done:k1] - g0
            at = positions[..., g0:g1]
            seqs = _Seqs(
                g1 - g0,
                tables.ctypes.data,
                width,
                width,
                lens[g0:].ctypes.data,
                at.data_ptr(),
                at.stride(0) if at.dim() == 2 else 0,
                rows[g0:].ctypes.data,
            )
            failed = self._run(
                ctypes.byref(self.decoder._decoder),
                ctypes.byref(seqs),
                embeds[g0:g1].data_ptr(),
                group_sample.ctypes.data,
                len(group_sample),
                out[done:k1].data_ptr() if k1 > done else None,
                threads,
            )
            self.decoder._check(failed)
            done = k1
        return out


def why_not_fused(model: nn.Module, attention: PagedAttention) -> str:
    """Why `FusedDecode` cannot run this model here ("" when it can)."""
    described = _described(model, attention)
    return described if isinstance(described, str) else ""


def _described(model: nn.Module, attention: PagedAttention) -> DecoderWeights | str:
    """The model's decoder as the C reads it (its `decoder_weights()`), or why it cannot."""
    lib, why = c_library()
    if lib is None:
        return why
    describe = getattr(model, "decoder_weights", None)
    if describe is None:
        return f"{type(model).__name__} does not describe its decoder (decoder_weights)"
    w = describe()
    if isinstance(w, str):
        return w
    dtype = w.final_norm.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 or bfloat16 models, not {dtype}"
    cache = attention.kv_cache
    if cache is None or cache.device.type != "cpu" or cache.dtype != dtype:
        return f"it needs a {dtype} KV cache on the CPU"
    if w.num_heads % w.num_kv_heads:
        return "query heads must be a multiple of the KV heads"
    if len(w.freq_axis) != w.head_dim // 2 or max(w.freq_axis) >= 3:
        return "its rotary frequencies do not fit its heads"
    for layer in w.layers:
        if (layer.q_norm is None) != (layer.k_norm is None):
            return "a layer normalises q or k per head but not both"
        moe = layer.router is not None
        if moe and getattr(model, "tensor_parallel", None) is not None:
            return "its MoE experts are split over tensor-parallel ranks (the C routes to all)"
        if moe and (w.num_experts < 1 or not 1 <= w.top_k <= min(w.num_experts, 64)):
            return "its MoE sizes do not fit (experts, top_k <= 64)"
        optional = {"qkv_bias", "q_norm", "k_norm"} | (
            {"gate_up", "down"} if moe else {"router", "experts_gate_up", "experts_down"}
        )
        for name, t in vars(layer).items():
            if t is None and name in optional:
                continue
            if t is None:
                return "the layers' dense weights were dropped (a packed kernel's choice)"
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                return f"it runs contiguous {dtype} weights on the CPU, not {t.dtype} on {t.device}"
    return w


def choose_fused_decode(
    model: nn.Module,
    attention: PagedAttention,
    step: Callable[[int, FusedDecode | None], object],
    max_seqs: int = MAX_SEQS,
    rounds: int = 3,
    cache_dir: Path | None = None,
) -> tuple[FusedDecode | None, str]:
    """Time `step(n, fused)` (a decode step of n sequences through `fused`, or the modules
    with None: the runner's `dummy_decode`) both ways, alternately, at n = 1, 2, 4, 8
    (`max_seqs` in place of those above it), and keep the fused decode for the sequence counts
    up to the largest n where it wins at every measured count up to it. Returns it (None:
    nowhere), and what was measured. The caller has checked that it can run (`why_not_fused`:
    the loader logs why not). The choice is cached in `cache_dir` under the linear kernels'
    key (CPU, torch, threads, model shape, kernel source): a large model's steps take long to
    time."""
    limit = min(max_seqs, MAX_SEQS)
    key = f"fused-{choice_key(linear_layers(model), limit)}"
    known = cached_choice(cache_dir, key)
    if known is not None:
        kept = known["kept"]
        return (FusedDecode(model, attention, kept) if kept else None), f"cached: {known['ms']}"
    fused = FusedDecode(model, attention)
    kept, measured = 0, []
    for n in sorted({min(n, limit) for n in (1, 2, 4, 8)}):
        best = {True: float("inf"), False: float("inf")}
        for _ in range(rounds):
            for on in (True, False):
                started = time.perf_counter()
                step(n, fused if on else None)
                best[on] = min(best[on], time.perf_counter() - started)
        measured.append(f"{n}: fused {best[True] * 1e3:.2f} / modules {best[False] * 1e3:.2f} ms")
        if best[True] >= best[False]:
            break
        kept = n
    fused.max_seqs = kept
    timings = "; ".join(measured)
    remember_choice(cache_dir, key, {"kept": kept, "ms": timings})
    return (fused if kept else None), timings
