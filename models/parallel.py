"""Tensor parallelism for the language models, in the Megatron manner.

Each of `size` ranks holds a slice of every large matrix and runs the same step on it:

- q / k / v and gate / up are split by output (column parallel): a rank computes its heads and
  its part of the MLP's width, with nothing to exchange;
- o and down are split by input (row parallel): each rank's product is a partial sum, added
  across the ranks by an all-reduce (a bias, where there is one, on rank 0 alone);
- KV heads are split across the ranks, or replicated where there are fewer than ranks (rank r
  then keeps KV head r // (size / kv_heads), as its query heads read);
- the embedding and the LM head are split by vocabulary: a rank looks up the ids in its range
  (an all-reduce adds the ranks' rows) and computes its range's logits (an all-gather joins
  them).

`shard_language_model` rewrites a model built on the meta device into its rank's shapes and
returns which slice of each checkpoint tensor the rank takes, so that `load_tensors` reads only
those bytes from the safetensors files. Families call it between building and loading; without
a `tensor_parallel` context it does nothing. Norms, rotary tables and q / k norms stay whole.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# A checkpoint tensor's slice: (dim, start, stop); a row past the tensor's end reads as zeros
# (the vocabulary's last shard, padded to the shards' common size).
Slice = tuple[int, int, int]


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: dist.ProcessGroup
    device: str | torch.device = "cpu"  # where its collectives' tensors live (NCCL: cuda:rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place: the sum over the ranks."""
        self.group.allreduce([x]).wait()
        return x

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return t.tolist()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


_CURRENT: contextvars.ContextVar[TensorParallel | None] = contextvars.ContextVar(
    "tensor_parallel", default=None
)


@contextlib.contextmanager
def tensor_parallel(tp: TensorParallel | None) -> Iterator[None]:
    """Models built (and loaded) inside are sharded for `tp`'s rank."""
    token = _CURRENT.set(tp)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> TensorParallel | None:
    return _CURRENT.get()


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` holds: its share, or, where there are fewer than ranks, the
    one its query heads read (head rank // (size / num_kv_heads), replicated)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads one rank holds."""
    return len(kv_heads_of(0, size, num_kv_heads))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of one vocabulary range: ids outside it give zeros, and the ranks'
    rows add up to the whole lookup."""

    def __init__(self, tp: TensorParallel, num_embeddings: int, dim: int, dtype=None):
        super().__init__()
        self.tp = tp
        self.per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(rows)


class VocabParallelHead(nn.Module):
    """The LM head's rows of one vocabulary range; the ranks' logits joined, the padding of the
    last range cut."""

    def __init__(self, tp: TensorParallel, vocab_size: int, dim: int, dtype=None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // tp.size), dim, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(hidden, self.weight))[..., : self.vocab_size]


def _all_reduce_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return module.tp_group.all_reduce(output)


def _linear(old: nn.Linear, in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=old.weight.dtype)


def shard_language_model(model: nn.Module) -> dict[str, Slice]:
    """In place, on a model still on the meta device: its modules in this rank's shapes (see
    the module docstring). Returns the slice of each checkpoint tensor (by local name) the rank
    loads; {} without tensor parallelism."""
    tp = current()
    if tp is None or tp.size == 1:
        return {}
    r, n = tp.rank, tp.size
    slices: dict[str, Slice] = {}
    for name, module in list(model.named_modules()):
        attn_heads = getattr(module, "num_heads", None)
        if hasattr(module, "q_proj") and hasattr(module, "o_proj") and attn_heads:
            _shard_attention(module, name, r, n, slices)
        elif hasattr(module, "gate_proj") and hasattr(module, "down_proj"):
            _shard_mlp(module, name, r, n, slices)
        elif hasattr(module, "experts") and hasattr(module, "gate"):
            _shard_experts(module, name, r, n, slices)
    vocab, dim = model.embed_tokens.weight.shape
    dtype = model.embed_tokens.weight.dtype
    per = -(-vocab // n)
    with torch.device("meta"):
        model.embed_tokens = VocabParallelEmbedding(tp, vocab, dim, dtype)
        model.lm_head = VocabParallelHead(tp, vocab, dim, dtype)
    slices["embed_tokens.weight"] = (0, r * per, (r + 1) * per)
    slices["lm_head.weight"] = (0, r * per, (r + 1) * per)
    model.tensor_parallel = tp
    return slices


def _shard_attention(attn: nn.Module, name: str, r: int, n: int, slices: dict) -> None:
    d = attn.head_dim if hasattr(attn, "head_dim") else attn.q_proj.out_features // attn.num_heads
    if attn.num_heads % n:
        raise ValueError(f"{attn.num_heads} attention heads do not split over {n} ranks")
    if attn.num_kv_heads % n and n % attn.num_kv_heads:
        raise ValueError(
            f"{attn.num_kv_heads} KV heads neither split over {n} ranks nor divide them (to be "
            "replicated)"
        )
    heads, kv = attn.num_heads // n, kv_heads_of(r, n, attn.num_kv_heads)
    parts = {
        "q_proj": (r * heads * d, heads * d),
        "k_proj": (kv.start * d, len(kv) * d),
        "v_proj": (kv.start * d, len(kv) * d),
    }
    for proj, (start, width) in parts.items():
        old = getattr(attn, proj)
        setattr(attn, proj, _linear(old, old.in_features, width, old.bias is not None))
        slices[f"{name}.{proj}.weight"] = (0, start, start + width)
        if old.bias is not None:
            slices[f"{name}.{proj}.bias"] = (0, start, start + width)
    _row_parallel(attn, "o_proj", name, r * heads * d, heads * d, slices)
    attn.num_heads, attn.num_kv_heads = heads, len(kv)


def _shard_mlp(mlp: nn.Module, name: str, r: int, n: int, slices: dict) -> None:
    if mlp.gate_proj.out_features % n:
        raise ValueError(
            f"the MLP's width {mlp.gate_proj.out_features} does not split over {n} ranks"
        )
    width = mlp.gate_proj.out_features // n
    for proj in ("gate_proj", "up_proj"):
        old = getattr(mlp, proj)
        setattr(mlp, proj, _linear(old, old.in_features, width, old.bias is not None))
        slices[f"{name}.{proj}.weight"] = (0, r * width, (r + 1) * width)
        if old.bias is not None:
            slices[f"{name}.{proj}.bias"] = (0, r * width, (r + 1) * width)
    _row_parallel(mlp, "down_proj", name, r * width, width, slices)


def _shard_experts(moe: nn.Module, name: str, r: int, n: int, slices: dict) -> None:
    """A sparse MLP's experts split across the ranks (the router whole on each): a rank runs
    the tokens routed to its experts, and an all-reduce adds the ranks' outputs."""
    experts = moe.experts
    total = experts.gate_up_proj.shape[0]
    if total % n:
        raise ValueError(f"{total} experts do not split over {n} ranks")
    held = total // n
    for param in ("gate_up_proj", "down_proj"):
        old = getattr(experts, param)
        setattr(experts, param, nn.Parameter(old.new_empty(held, *old.shape[1:])))
        slices[f"{name}.experts.{param}"] = (0, r * held, (r + 1) * held)
    experts.first_expert = r * held
    experts.tp_group = current()
    experts.register_forward_hook(_all_reduce_output)


def _row_parallel(parent: nn.Module, proj: str, name: str, start: int, width: int, slices):
    """`parent.proj` split by input columns, its output all-reduced (a forward hook: it stays
    on the module whichever CPU kernel the loader gives it). The bias is rank 0's alone."""
    tp = current()
    old = getattr(parent, proj)
    new = _linear(old, width, old.out_features, old.bias is not None)
    new.tp_group = tp
    new.register_forward_hook(_all_reduce_output)
    setattr(parent, proj, new)
    slices[f"{name}.{proj}.weight"] = (1, start, start + width)
    if old.bias is not None and tp.rank != 0:
        slices[f"{name}.{proj}.bias"] = (0, 0, 0)  # zeros: rank 0 adds the bias


def read_slice(f, name: str, shape: list[int], where: Slice) -> torch.Tensor:
    """Only the slice's bytes of a safetensors tensor (`f`: an open safe_open); rows past its
    end as zeros; an empty slice as zeros of the whole size (a bias rank 0 adds)."""
    dim, start, stop = where
    if start == stop:
        return f.get_tensor(name).zero_()
    end = min(stop, shape[dim])
    view = f.get_slice(name)
    index = tuple(slice(start, end) if i == dim else slice(None) for i in range(len(shape)))
    part = view[index]
    if end < stop:  # the vocabulary's last shard, padded
        pad = list(part.shape)
        pad[dim] = stop - end
        part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim=dim)
    return part
