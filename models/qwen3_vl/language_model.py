"""The Qwen3-VL language model (dense and MoE) in the engine's flattened token layout.

Against the Qwen2 decoder (models/qwen2_vl/language_model.py):

- attention has no q / k / v biases (unless `attention_bias`) and RMS-normalises each query and
  key head (`q_norm`, `k_norm`) before the rotary embedding;
- M-RoPE is interleaved (models/qwen2_vl/rope.py's `mrope_freq_axes`);
- MoE checkpoints replace the MLP of their sparse layers by a router and experts
  (`SparseMoE`); on the CPU only the experts a token was routed to run for it;
- deepstack: each media row the step carries holds its main embedding and one level per
  deepstack merger ([rows, levels, hidden], as the encoder published it). `embed_input_ids`
  puts the main embeddings into the prompt and keeps the levels for the forward that follows,
  which adds level i to the hidden states at those rows after decoder layer i. A chunk that
  cuts an item gathers exactly its rows of every level (lm_worker/inputs.py slices rows).
  Decode steps carry no media rows, so they add nothing: the levels matter at prefill only,
  and a decode worker that takes a prefilled request's KV needs none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionBackend
from models.checkpoint import CheckpointError, assign_lm_weights, load_tensors
from models.layers import (
    DecoderWeights,
    GatedMLP,
    PreNormDecoderLayer,
    RMSNorm,
    apply_rotary_tables,
    describe_merged_decoder,
    merge_linears,
    rotary_tables,
)
from models.parallel import shard_language_model
from models.qwen2_vl.language_model import lm_tensor
from models.qwen2_vl.rope import MRotaryEmbedding
from models.qwen3_vl.config import MoEConfig, TextConfig

# On a GPU, MoE steps of at most this many tokens (decode batches, and so every CUDA graph)
# run every expert densely with zero weights for the unrouted ones: static shapes, which a
# graph can capture. Larger steps (prefill), and every step on a CPU, run routed experts only.
DENSE_MOE_MAX_TOKENS = 256


class Qwen3Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = d = config.head_dim
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # set by `merge`

    def merge(self) -> None:
        self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos, sin, attn_metadata: Any) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split(
                (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d), dim=-1
            )
        q = apply_rotary_tables(self.q_norm(q.reshape(T, self.num_heads, d)), cos, sin)
        k = apply_rotary_tables(self.k_norm(k.reshape(T, self.num_kv_heads, d)), cos, sin)
        v = v.reshape(T, self.num_kv_heads, d)
        out = self.backend(self.layer_idx, q, k, v, attn_metadata)
        return self.o_proj(out.reshape(T, -1))


class Experts(nn.Module):
    """The experts' SwiGLU weights, fused as transformers holds them: gate_up [E, 2I, H] (gate
    rows first), down [E, H, I]. Released checkpoints store each transposed ([E, H, 2I],
    [E, I, H]); `load_weights` takes either."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        # The share of these weights one token's step reads (its top_k experts): what a
        # batch-1 decode's roofline counts (lm_worker/cpu_kernels.py weight_bytes).
        self.read_fraction = moe.top_k / moe.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))
        # Under tensor parallelism a rank holds experts first_expert .. + E_local
        # (models/parallel.py): tokens routed elsewhere are another rank's.
        self.first_expert = 0

    def forward(
        self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor
    ) -> torch.Tensor:
        # This module's experts by local index; routes to other ranks' experts to index E_local
        # (the routed path's and the dense path's spare slot).
        held = self.gate_up_proj.shape[0]
        top_index = top_index - self.first_expert
        top_index = top_index.masked_fill((top_index < 0) | (top_index >= held), held)
        if x.is_cuda and x.shape[0] <= DENSE_MOE_MAX_TOKENS:
            return self.dense(x, top_index, top_weight)
        return self.routed(x, top_index, top_weight)

    def routed(self, x, top_index, top_weight) -> torch.Tensor:
        """Each expert over the tokens routed to it, added in expert order."""
        out = torch.zeros_like(x)
        hit = torch.zeros(self.gate_up_proj.shape[0] + 1, dtype=torch.long, device=x.device)
        # (the last slot: routes to no expert of this module's)
        hit.scatter_(0, top_index.flatten(), 1)
        for e in hit[:-1].nonzero().flatten().tolist():
            token, slot = torch.where(top_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_weight[token, slot, None])
        return out

    def dense(self, x, top_index, top_weight) -> torch.Tensor:
        """Every expert over every token, unrouted pairs weighted zero: static shapes."""
        held = self.gate_up_proj.shape[0]
        weights = torch.zeros(x.shape[0], held + 1, dtype=x.dtype, device=x.device)
        weights = weights.scatter_(1, top_index, top_weight)[:, :held]  # [T, E]
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
        return (y * weights.T[:, :, None]).sum(0)


class SparseMoE(nn.Module):
    """Router (softmax over the experts, the top k kept, renormalised when the config says)
    and experts."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(hidden, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top_weight, top_index = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        return self.experts(x, top_index, top_weight.to(logits.dtype))


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        if moe is not None and moe.is_sparse(layer_idx):
            self.mlp: nn.Module = SparseMoE(config.hidden_size, moe)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class Qwen3LanguageModel(nn.Module):
    """The LM of Qwen3-VL and Qwen3-VL-MoE: embeddings, decoder, final norm, LM head."""

    requires_raw_input_tokens = False
    supports_realtime = False
    supports_multimodal_pruning = True  # EVS: its model state strips position channels

    def __init__(self, config: TextConfig, attn_backend: AttentionBackend, num_levels: int = 1):
        super().__init__()
        self.config = config
        self.num_levels = num_levels  # rows per media placeholder: main + deepstack levels
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, attn_backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = MRotaryEmbedding(
            config.head_dim, config.rope_theta, config.mrope_section, interleaved=True
        )
        # (row indices [n], levels [levels - 1, n, hidden]) of the step `embed_input_ids` made
        # last, for the forward that follows it; taken (and cleared) by that forward.
        self._deepstack: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: TextConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_levels: int = 1,
    ) -> Qwen3LanguageModel:
        with torch.device("meta"):
            model = cls(config, attn_backend, num_levels)
        slices = shard_language_model(model)  # {} without tensor parallelism
        model.load_weights(load_tensors(checkpoint_dir, lm_tensor, "lm", dtype, device, slices))
        return model.to(device).eval()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = dict(tensors)
        moe = self.config.moe
        if moe is not None:
            h, i = self.config.hidden_size, moe.intermediate_size
            for name in list(tensors):
                if name.endswith("mlp.experts.gate_up_proj"):
                    tensors[name] = _expert_layout(tensors[name], (2 * i, h), name)
                elif name.endswith("mlp.experts.down_proj"):
                    tensors[name] = _expert_layout(tensors[name], (h, i), name)
        assign_lm_weights(self, tensors, self.config.tie_word_embeddings)

    def merge_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.merge()
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.merge()

    def decoder_weights(self) -> DecoderWeights | str:
        """The decoder (dense or MoE) as the fused CPU decode reads it (models/layers.py), or
        why not."""
        return describe_merged_decoder(self)

    @property
    def prefill_beyond_decoder(self) -> str | None:
        """What its prefill adds besides the decoder `decoder_weights` describes (the
        batch-invariant C forward, which runs prefill too, refuses a model that adds any)."""
        return "the deepstack levels" if self.num_levels > 1 else None

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,  # [T]
        mm_embeds: list[torch.Tensor] | None = None,  # each [n_i, levels, hidden]
        is_mm_embed: torch.Tensor | None = None,  # [T] bool, sum == sum(n_i)
    ) -> torch.Tensor:  # [T, hidden]
        self._deepstack = None
        embeds = self.embed_tokens(input_ids)
        if not mm_embeds:
            return embeds
        assert is_mm_embed is not None, "mm_embeds need is_mm_embed"
        rows = torch.cat(mm_embeds).to(embeds.dtype)
        if rows.dim() != 3 or rows.shape[1] != self.num_levels:
            raise ValueError(
                f"media rows of shape {tuple(rows.shape)}: this model takes "
                f"[rows, {self.num_levels} levels, hidden]"
            )
        index = is_mm_embed.nonzero().flatten()
        if index.numel() != rows.shape[0]:
            raise ValueError(
                f"{index.numel()} rows marked multimodal but {rows.shape[0]} embeddings"
            )
        embeds = embeds.masked_scatter(is_mm_embed[:, None], rows[:, 0].contiguous())
        if self.num_levels > 1:
            self._deepstack = (index, rows[:, 1:].transpose(0, 1))
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,  # [3, T] or [T]
        inputs_embeds: torch.Tensor | None = None,
        attn_metadata: Any = None,
        intermediate_tensors: Any = None,
    ) -> torch.Tensor:
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        deepstack, self._deepstack = self._deepstack, None
        x = inputs_embeds
        cos, sin = rotary_tables(*self.rotary(positions, x.dtype))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_metadata)
            if deepstack is not None and i < len(deepstack[1]):
                index, levels = deepstack
                x = x.index_add(0, index, levels[i])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _expert_layout(t: torch.Tensor, per_expert: tuple[int, int], name: str) -> torch.Tensor:
    """An expert tensor as [E, *per_expert]: transposed when the checkpoint stores it the
    released way round ([E, *reversed(per_expert)]; that reading wins for a square shape,
    since it is what transformers writes)."""
    if t.dim() == 3 and tuple(t.shape[1:]) == per_expert[::-1]:
        return t.transpose(1, 2).contiguous()
    if t.dim() == 3 and tuple(t.shape[1:]) == per_expert:
        return t
    raise CheckpointError(
        f"{name}: shape {tuple(t.shape)}, the config gives [experts, {per_expert[0]}, "
        f"{per_expert[1]}] (or transposed)"
    )
