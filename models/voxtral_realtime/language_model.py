"""The Voxtral Realtime language model (Mistral-style), in the engine's flattened token layout.

Differences from a plain Mistral decoder:
- every position's input is its token embedding PLUS the audio embedding of that position
  (`embed_input_ids` adds rather than replaces), on decode steps too (`supports_realtime`);
- attention is causal over a sliding window of `sliding_window` positions;
- before each MLP the normalised hidden state is scaled by (1 + ada(t)), where t is the
  sinusoidal embedding of the streaming delay (in tokens) and ada a small two-layer net.
  The delay is fixed per checkpoint, so the per-layer scale is computed once at load;
- the head is tied to the token embedding.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionBackend
from models.checkpoint import assign_lm_weights, load_tensors, strip_prefixes
from models.layers import GatedMLP, RMSNorm, apply_rotary, inverse_frequencies
from models.parallel import shard_language_model
from models.voxtral_realtime.config import TextConfig

# transformers writes `language_model.model.*` (and `lm_head.weight` when untied).
_LM_TENSORS = strip_prefixes("model.language_model.", "language_model.model.")


def lm_tensor(name: str) -> str | None:
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    return _LM_TENSORS(name)


def time_embedding(num_delay_tokens: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[dim]: cos and sin of the delay times 10000^(-i / (dim / 2))."""
    half = dim // 2
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(half, device="cpu").float() / half)
    t = torch.full((1,), float(num_delay_tokens), dtype=dtype) * inv_freq.to(dtype)
    return torch.cat((t.cos(), t.sin()))


class AdaNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear1 = nn.Linear(hidden, 32, bias=False)
        self.linear2 = nn.Linear(32, hidden, bias=False)

    def forward(self, t_cond: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(t_cond)))


class Attention(nn.Module):
    def __init__(self, c: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding_window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos, sin, attn_metadata: Any) -> torch.Tensor:
        T = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        out = self.backend(
            self.layer_idx, q, k, v, attn_metadata, sliding_window=self.sliding_window
        )
        return self.o_proj(out.reshape(T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ada_rms_norm = AdaNorm(c.hidden_size)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.ada_scale: torch.Tensor | None = None  # [hidden]: 1 + ada(t), set at load

    def forward(self, x: torch.Tensor, cos, sin, attn_metadata: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
        h = self.post_attention_layernorm(x) * self.ada_scale
        return x + self.mlp(h)


class VoxtralLanguageModel(nn.Module):
    requires_raw_input_tokens = False
    supports_realtime = True  # every position (decode steps too) adds its audio embedding
    supports_multimodal_pruning = False

    def __init__(self, config: TextConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attn_backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.head_dim, config.rope_theta), persistent=False
        )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: TextConfig,
        num_delay_tokens: int,
        attn_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> VoxtralLanguageModel:
        with torch.device("meta"):
            model = cls(config, attn_backend)
        slices = shard_language_model(model)  # {} without tensor parallelism
        model.load_weights(load_tensors(checkpoint_dir, lm_tensor, "lm", dtype, device, slices))
        model.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta).to(device)
        with torch.no_grad():
            model.set_delay(num_delay_tokens)
        return model.to(device).eval()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the checkpoint's LM tensors (local names) as this model's parameters."""
        assign_lm_weights(self, tensors, self.config.tie_word_embeddings)

    def set_delay(self, num_delay_tokens: int) -> None:
        """The per-layer MLP input scale (1 + ada(t)) for a streaming delay in tokens (with
        gradients where they are enabled: training sets it every step)."""
        w = self.embed_tokens.weight
        t_cond = time_embedding(num_delay_tokens, self.config.hidden_size, w.dtype).to(w.device)
        for layer in self.layers:
            layer.ada_scale = 1 + layer.ada_rms_norm(t_cond)

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,  # [T]
        mm_embeds: list[torch.Tensor] | None = None,  # each [n_i, hidden]
        is_mm_embed: torch.Tensor | None = None,  # [T] bool
    ) -> torch.Tensor:  # [T, hidden]
        embeds = self.embed_tokens(input_ids)
        if mm_embeds:
            assert is_mm_embed is not None, "mm_embeds need is_mm_embed"
            rows = torch.cat(mm_embeds).to(embeds.dtype)
            index = is_mm_embed.nonzero().squeeze(1)
            if index.shape[0] != rows.shape[0]:
                raise ValueError(
                    f"{index.shape[0]} rows marked audio but {rows.shape[0]} embeddings"
                )
            embeds = embeds.index_add(0, index, rows)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,  # [T] or [1, T]
        inputs_embeds: torch.Tensor | None = None,
        attn_metadata: Any = None,
        intermediate_tensors: Any = None,
    ) -> torch.Tensor:
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        pos = positions.reshape(-1).to(torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
