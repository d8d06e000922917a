"""Building blocks more than one family uses: RMSNorm, the rotary-embedding math, and the
description of a decoder that a fused decode reads (`DecoderWeights`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalised in float32, cast back, then scaled: the reference's rounding order.
        # (x * x is bit for bit x.pow(2); float32 skips the no-op casts: each is a dispatch,
        # and a decode step of one token runs this 2 x layers + 1 times.)
        if x.dtype == torch.float32:
            if torch.is_grad_enabled():
                return self.weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps))
            # Inference: the same operations, in place on the temporaries (no allocation);
            # weight * y and y * weight are the same products.
            scale = (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return (x * scale).mul_(self.weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def merge_linears(*layers: nn.Linear) -> nn.Linear:
    """One linear layer computing `layers` side by side on the same input (outputs concatenated
    in order): one matrix product that streams all their weights in one pass, where a decode
    step of one row is bound by reading them. Each output is the same dot product as before."""
    first = layers[0]
    has_bias = first.bias is not None
    for m in layers:
        if m.in_features != first.in_features or (m.bias is not None) != has_bias:
            raise ValueError("merged layers must share their input width and bias use")
    merged = nn.Linear(
        first.in_features,
        sum(m.out_features for m in layers),
        bias=has_bias,
        device="meta",
    )
    merged.weight = nn.Parameter(torch.cat([m.weight.detach() for m in layers]))
    if has_bias:
        merged.bias = nn.Parameter(torch.cat([m.bias.detach() for m in layers]))
    return merged


class PreNormDecoderLayer(nn.Module):
    """x += self_attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x)): the Qwen2
    and Qwen3 decoder layers' step (each builds its own modules of those names)."""

    def forward(self, x: torch.Tensor, cos, sin, attn_metadata) -> torch.Tensor:
        if torch.is_grad_enabled():
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
            return x + self.mlp(self.post_attention_layernorm(x))
        # Inference: each residual added in place into the branch's fresh output (x + y and
        # y + x are the same sums); x itself may be the runner's input buffer.
        x = self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class GatedMLP(nn.Module):
    """SwiGLU without biases: down(silu(gate(x)) * up(x)), the Qwen2 and Mistral LMs' MLP.
    `merge` (inference) replaces gate and up by one layer computing both."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def merge(self) -> None:
        self.gate_up_proj = merge_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * up)
        # Inference: in place on the merged output (gate is its own temporary's view).
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


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


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, head_dim] made once per forward for `apply_rotary_tables` in every layer:
    [T, 1, head_dim], the sine's first half negated."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], signed[:, None, :]


def apply_rotary_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
    """`apply_rotary` from `rotary_tables`, in four operations instead of nine, bit for bit:
    rotate_half(x) * sin is [-x2, x1] * [s1, s2], and (-x2) * s1 == x2 * (-s1) exactly, so it
    is roll(x) * [-s1, s2] (roll by half a head is [x2, x1])."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return (x * cos).add_(rolled)


@dataclass
class DecoderLayerWeights:
    """One pre-norm decoder layer: x += o(attention(rope(qkv(norm1(x))))) (Qwen3: q and k
    RMS-normed per head before the rope); then
    x += down(silu(gate) * up)(norm2(x)), with q / k / v and gate / up merged."""

    norm1: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) head_dim, hidden]: q, k, v stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads head_dim], no bias
    norm2: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 intermediate, hidden]: gate, then up (None: MoE)
    down: torch.Tensor | None  # [hidden, intermediate]
    # Qwen3: each query and key head RMS-normalised (these scales, [head_dim]) before the
    # rotary; None: no such norm.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # A sparse MoE layer (gate_up and down None): the router [experts, hidden] and the
    # experts' gate_up [experts, 2 moe_intermediate, hidden] and down [experts, hidden,
    # moe_intermediate] (DecoderWeights says top_k and the renormalisation).
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    """A language model's decoder as a fused decode reads it (the LM worker's CPU decode in C:
    lm_worker/cpu_decode.py): its layers' tensors, the final norm, RMSNorm's epsilon, its sizes,
    and its rotary embedding: frequency j turns with `inv_freq[j]` times the token's position on
    axis `freq_axis[j]` of the forward's positions (one axis, 0, for plain RoPE)."""

    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    freq_axis: list[int]  # [head_dim / 2]
    # The ends of a whole step, token ids to logits (None: the model offers none): the token
    # embedding table, where a text token's embedding is its row as it is, and the LM head's
    # weight (no bias); each [vocab, hidden].
    embed: torch.Tensor | None = None
    head: torch.Tensor | None = None
    # MoE layers' sizes (0 experts: none): top_k experts a token, their weights renormalised
    # over the chosen when norm_topk.
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = True


def describe_merged_decoder(lm) -> DecoderWeights | str:
    """`DecoderWeights` of a Qwen-style LM with merged projections (Qwen2, Qwen3): its
    `layers` (each `input_layernorm`, `self_attn.qkv_proj` / `o_proj` and, Qwen3, `q_norm` /
    `k_norm`, `post_attention_layernorm`, and `mlp.gate_up_proj` / `down_proj`, or a sparse
    MoE's `mlp.gate` / `mlp.experts` with its `moe` sizes), `norm`, `rotary` (`inv_freq`,
    `freq_axis`), `embed_tokens`, `lm_head` and `config` sizes; or why not."""
    layers, moe = [], None
    for layer in lm.layers:
        attn, mlp = layer.self_attn, layer.mlp
        experts = getattr(mlp, "experts", None)
        if attn.qkv_proj is None or (experts is None and mlp.gate_up_proj is None):
            return "its projections are not merged (merge_projections)"
        if attn.o_proj.bias is not None:
            return "o_proj has a bias"
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        dense = (
            (None, None) if experts is not None else (mlp.gate_up_proj.weight, mlp.down_proj.weight)
        )
        sparse = (None, None, None)
        if experts is not None:
            moe = mlp.moe
            sparse = (mlp.gate.weight, experts.gate_up_proj, experts.down_proj)
        layers.append(
            DecoderLayerWeights(
                layer.input_layernorm.weight,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
                attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                *dense,
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                *sparse,
            )
        )
    c = lm.config
    attn = lm.layers[0].self_attn  # its heads: a tensor-parallel rank's share (models/parallel)
    dense = next((layer.mlp for layer in lm.layers if hasattr(layer.mlp, "gate_up_proj")), None)
    return DecoderWeights(
        layers,
        lm.norm.weight,
        lm.norm.eps,
        attn.num_heads,
        attn.num_kv_heads,
        c.head_dim,
        dense.gate_up_proj.out_features // 2 if dense is not None else c.intermediate_size,
        lm.rotary.inv_freq.float(),
        lm.rotary.freq_axis,
        lm.embed_tokens.weight,
        lm.lm_head.weight,  # None where a packed kernel's choice dropped it
        moe.num_experts if moe else 0,
        moe.top_k if moe else 0,
        moe.intermediate_size if moe else 0,
        moe.norm_topk_prob if moe else True,
    )
