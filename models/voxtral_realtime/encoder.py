"""The causal audio encoder (a Whisper-style tower made streamable) and the projector.

    log-mel [mels, F] -> causal conv (k3) -> GELU -> causal conv (k3, stride 2) -> GELU
      -> layers of (RMSNorm, sliding-window causal self-attention with RoPE, RMSNorm, SwiGLU)
      -> RMSNorm -> [F / 2, width]
    projector: `downsample_factor` consecutive frames stacked -> Linear -> GELU -> Linear
      -> one embedding per LM position [F / audio_length_per_tok, hidden]

Causal convolutions pad on the left only, and every frame attends to itself and the
`sliding_window - 1` frames before it, so an embedding depends on the audio up to its own
position: a whole clip computed at once equals the same clip fed chunk by chunk. Attention
runs in query blocks over just their window, so memory grows with the window, not the clip.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import assign_module_weights, strip_prefixes
from models.layers import RMSNorm, apply_rotary, inverse_frequencies
from models.voxtral_realtime.config import AudioEncoderConfig, VoxtralConfig

# transformers writes `audio_tower.*` / `multi_modal_projector.*`; module paths under `model.`
# are accepted too.
TOWER_TENSORS = strip_prefixes("model.audio_tower.", "audio_tower.")
PROJECTOR_TENSORS = strip_prefixes("model.multi_modal_projector.", "multi_modal_projector.")


def encoder_tensor(name: str) -> str | None:
    local = TOWER_TENSORS(name)
    if local is not None:
        return "tower." + local
    local = PROJECTOR_TENSORS(name)
    return None if local is None else "projector." + local


class CausalConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, F]
        left = (self.kernel_size[0] - 1) * self.dilation[0] + 1 - self.stride[0]
        return super().forward(F.pad(x, (left, 0)))


class EncoderAttention(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        inner = c.num_heads * c.head_dim
        self.window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, inner, bias=True)
        self.k_proj = nn.Linear(c.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, inner, bias=True)
        self.o_proj = nn.Linear(inner, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [n, width], or [clips, n, width] (training batches clips of one length)
        lead, n = x.shape[:-2], x.shape[-2]
        q = self.q_proj(x).view(*lead, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, n, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, n, self.num_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)  # [.., H, n, d]
        out = torch.empty_like(q)
        block = max(self.window, 64)
        for s in range(0, n, block):
            e = min(s + block, n)
            lo = max(0, s - self.window + 1)
            qi = torch.arange(s, e, device=x.device)[:, None]
            kj = torch.arange(lo, e, device=x.device)[None, :]
            mask = (kj <= qi) & (qi - kj < self.window)
            out[..., s:e, :] = F.scaled_dot_product_attention(
                q[..., s:e, :],
                k[..., lo:e, :],
                v[..., lo:e, :],
                attn_mask=mask,
                scale=self.head_dim**-0.5,
            )
        return self.o_proj(out.transpose(-3, -2).reshape(*lead, n, -1))


class EncoderMLP(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.self_attn_layer_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = EncoderAttention(c)
        self.final_layer_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = EncoderMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cos, sin)
        return x + self.mlp(self.final_layer_norm(x))


class Embedder(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.conv1 = CausalConv1d(c.num_mel_bins, c.hidden_size, kernel_size=3)
        self.conv2 = CausalConv1d(c.hidden_size, c.hidden_size, kernel_size=3, stride=2)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # [mels, F] -> [F / 2, width], or [clips, mels, F] -> [clips, F / 2, width]
        x = F.gelu(self.conv1(mel if mel.dim() == 3 else mel[None]))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return x if mel.dim() == 3 else x[0]


class AudioTower(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.config = c
        self.embedder = Embedder(c)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer(
            "inv_freq", inverse_frequencies(c.head_dim, c.rope_theta), persistent=False
        )

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # [mels, F] -> [F / 2, width], or [clips, mels, F] -> [clips, F / 2, width]
        x = self.embedder(mel)
        positions = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Projector(nn.Module):
    def __init__(self, audio_width: int, downsample: int, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(audio_width * downsample, hidden, bias=False)
        self.linear_2 = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class AudioEncoder(nn.Module):
    """Log-mel features of one padded clip in, one embedding per LM position out."""

    def __init__(self, config: VoxtralConfig):
        super().__init__()
        self.config = config
        self.tower = AudioTower(config.audio)
        self.projector = Projector(
            config.audio.hidden_size, config.downsample_factor, config.text.hidden_size
        )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: VoxtralConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> AudioEncoder:
        with torch.device("meta"):
            model = cls(config)
        assign_module_weights(model, checkpoint_dir, encoder_tensor, "audio encoder", dtype, device)
        c = config.audio
        model.tower.inv_freq = inverse_frequencies(c.head_dim, c.rope_theta).to(device)
        return model.to(device).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.linear_1.weight.dtype

    def frames(self, mel: torch.Tensor) -> torch.Tensor:
        """The tower's output [F / 2, width] (the encoder's hidden states)."""
        return self.tower(mel.to(self.dtype))

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor) -> torch.Tensor:  # [mels, F] -> [F / per_tok, hidden]
        return self.embeddings(mel)

    def embeddings(self, mel: torch.Tensor) -> torch.Tensor:
        """`forward` with gradients, for a clip or a batch of clips of one length:
        [(clips,) mels, F] -> [(clips,) F / per_tok, hidden]."""
        x = self.frames(mel)
        d = self.config.downsample_factor
        n = x.shape[-2]
        usable = n - n % d
        return self.projector(x[..., :usable, :].reshape(*x.shape[:-2], usable // d, -1))
