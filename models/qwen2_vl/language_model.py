"""The Qwen2 decoder both families share, in the engine's flattened token layout.

No batch dimension: a step is T tokens of any number of sequences packed back to back, with
M-RoPE positions [3, T]. Attention goes through the `AttentionBackend` given at construction,
which owns the KV cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.attention import AttentionBackend
from models.checkpoint import assign_lm_weights, load_tensors, strip_prefixes
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
from models.qwen2_vl.config import TextConfig
from models.qwen2_vl.rope import MRotaryEmbedding

# Released checkpoints name the LM's tensors `model.X`, transformers >= 5
# `model.language_model.X`; the head is `lm_head.weight` in both.
_LM_TENSORS = strip_prefixes("model.language_model.", "model.", exclude=("model.visual.",))


def lm_tensor(name: str) -> str | None:
    return name if name == "lm_head.weight" else _LM_TENSORS(name)


class Qwen2Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_heads * config.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv, bias=True)
        self.v_proj = nn.Linear(hidden, kv, bias=True)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, hidden, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by `merge`

    def merge(self) -> None:
        """One layer computing q, k and v (one pass over their weights instead of three)."""
        self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        """`cos` / `sin`: the forward's `rotary_tables`."""
        T = x.shape[0]
        if self.qkv_proj is None:
            q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_tables(q, cos, sin), apply_rotary_tables(k, cos, sin)
        else:
            # q and k sit side by side in the merged output: rotated in one pass.
            qkv = self.qkv_proj(x)
            heads = self.num_heads + self.num_kv_heads
            qk = apply_rotary_tables(
                qkv[:, : heads * self.head_dim].view(T, heads, self.head_dim), cos, sin
            )
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            v = qkv[:, heads * self.head_dim :].view(T, self.num_kv_heads, self.head_dim)
        out = self.backend(self.layer_idx, q, k, v, attn_metadata)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(T, -1))


class Qwen2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class Qwen2LanguageModel(nn.Module):
    """The LM of Qwen2-VL and Qwen2.5-VL: embeddings, decoder, final norm, LM head."""

    # Capabilities the engine reads once.
    requires_raw_input_tokens = False
    supports_realtime = False
    supports_multimodal_pruning = True  # EVS: the model state strips position channels

    def __init__(self, config: TextConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(config, i, attn_backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints share one matrix: the head's weight is the embedding's (set in
        # load_weights, once the embedding is real).
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: TextConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Qwen2LanguageModel:
        """Build the LM and load its tensors (never the vision tower's)."""
        with torch.device("meta"):
            model = cls(config, attn_backend)
        slices = shard_language_model(model)  # {} without tensor parallelism
        model.load_weights(load_tensors(checkpoint_dir, lm_tensor, "lm", dtype, device, slices))
        return model.to(device).eval()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the checkpoint's LM tensors (local names) as this model's parameters."""
        assign_lm_weights(self, tensors, self.config.tie_word_embeddings)

    def merge_projections(self) -> None:
        """For inference: q / k / v, and the MLP's gate / up, each become one linear layer
        (weights concatenated), so a decode step makes two matrix products per layer fewer and
        streams the weights in longer runs. Outputs are the same dot products."""
        for layer in self.layers:
            layer.self_attn.merge()
            layer.mlp.merge()

    def decoder_weights(self) -> DecoderWeights | str:
        """The decoder as a fused decode reads it, or why it cannot (models/layers.py)."""
        return describe_merged_decoder(self)

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,  # [T]
        mm_embeds: list[torch.Tensor] | None = None,  # each [n_i, hidden]
        is_mm_embed: torch.Tensor | None = None,  # [T] bool, sum == sum(n_i)
    ) -> torch.Tensor:  # [T, hidden]
        embeds = self.embed_tokens(input_ids)
        if mm_embeds:
            assert is_mm_embed is not None, "mm_embeds need is_mm_embed"
            rows = torch.cat(mm_embeds).to(embeds.dtype)
            count = int(is_mm_embed.sum())
            if count != rows.shape[0]:
                raise ValueError(f"{count} rows marked multimodal but {rows.shape[0]} embeddings")
            embeds = embeds.masked_scatter(is_mm_embed[:, None], rows)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [3, T] (M-RoPE) or [T]
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]
        attn_metadata: Any = None,
        intermediate_tensors: Any = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rotary_tables(*self.rotary(positions, x.dtype))
        for layer in self.layers:
            x = layer(x, cos, sin, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, vocab]
        return self.lm_head(hidden)
