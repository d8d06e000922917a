"""The vision towers of Qwen2-VL and Qwen2.5-VL (the encoder worker's side).

Both: a patch embedding (a Conv3d whose kernel equals its stride, so a matrix product over the
flattened patches), 2-D rotary attention, and a merger that concatenates each 2x2 block of
patches and projects it to the LM's width. They differ in the blocks:

| | Qwen2-VL | Qwen2.5-VL |
|---|---|---|
| norm | LayerNorm | RMSNorm |
| MLP | fc1, quick_gelu, fc2 | SwiGLU (gate, up, down, with biases) |
| attention | full, per frame | windows of window_size pixels, full in `fullatt_block_indexes` |

Items of different sizes run in one forward: patches are packed back to back and attention
stays within segments (frames, or windows) of the packed sequence, as the reference's
`cu_seqlens` delimit them. Segments of equal length are attended in one batched call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import CheckpointError, assign_module_weights, strip_prefixes
from models.layers import RMSNorm, inverse_frequencies, rotate_half
from models.qwen2_vl.config import VisionConfig

GridTHW = Sequence[tuple[int, int, int]] | torch.Tensor

# Released checkpoints name the tower's tensors `visual.X`, transformers >= 5 `model.visual.X`.
VISION_TENSORS = strip_prefixes("visual.", "model.visual.")

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class PatchEmbed(nn.Module):
    """The patches' Conv3d (Qwen3-VL's has a bias) as the matrix product it is."""

    def __init__(self, config, bias: bool = False):
        super().__init__()
        t, p = config.temporal_patch_size, config.patch_size
        # Kept as the checkpoint's Conv3d so tensor names and shapes load as they are.
        self.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, (t, p, p), (t, p, p), bias=bias
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [N, C * T * P * P] -> [N, hidden]; the kernel covers the whole patch.
        weight = self.proj.weight
        flat = weight.reshape(weight.shape[0], -1)
        return F.linear(pixel_values.to(weight.dtype), flat, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments
    ) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, -1).unbind(1)  # [N, heads, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segments.attend(q, k, v).reshape(N, -1))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen25VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, dim: int) -> nn.Module:
    if config.layer_norm:
        return nn.LayerNorm(dim, eps=1e-6)
    return RMSNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP. Qwen3-VL's blocks are these with LayerNorms and its own MLP
    (`norm`, `mlp` given); by default the config's norm and Qwen2 / Qwen2.5's MLP."""

    def __init__(
        self,
        config,
        norm: Callable[[], nn.Module] | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        norm = norm or (lambda: _norm(config, config.hidden_size))
        self.norm1 = norm()
        self.norm2 = norm()
        self.attn = VisionAttention(config)
        if mlp is None:
            mlp = (Qwen25VisionMLP if config.gated_mlp else Qwen2VisionMLP)(config)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge_size x merge_size block of patches -> one token of the LM's width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = _norm(config, config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x)
        return self.mlp(x.view(-1, self.mlp[0].in_features))


class VisionTower(nn.Module):
    """pixel_values + grids of several items -> one embedding tensor per item."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        # 2-D rotary: a quarter of head_dim rotates with the row, a quarter with the column.
        freqs = inverse_frequencies(config.head_dim // 2, config.rope_theta)
        self.register_buffer("inv_freq", freqs, persistent=False)
        if config.window_size:
            merged_window = config.window_size // config.spatial_merge_size // config.patch_size
            if merged_window < 1:
                raise CheckpointError(
                    f"vision window_size {config.window_size} is smaller than one merged patch"
                )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: VisionConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> VisionTower:
        """Build the tower and load its tensors (never the LM's)."""
        with torch.device("meta"):
            tower = cls(config)
        assign_module_weights(tower, checkpoint_dir, VISION_TENSORS, "vision", dtype, device)
        return tower.to(device).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @torch.inference_mode()
    def embed_multimodal(
        self,
        pixel_values: torch.Tensor,  # [sum of t*h*w, C * T * P * P], items back to back
        grid_thw: GridTHW,  # [num_items, 3]
    ) -> list[torch.Tensor]:  # one [t*h*w / merge**2, out_hidden] per item
        """What the encoder serves: `forward` without autograd."""
        return self(pixel_values, grid_thw)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> list[torch.Tensor]:
        """As `embed_multimodal`, differentiable (training runs this)."""
        m = self.config.spatial_merge_size
        m2 = m * m
        grids = checked_grids(pixel_values, grid_thw, m)
        device = self.patch_embed.proj.weight.device
        x = self.patch_embed(pixel_values.to(device))  # [N, hidden]
        cos, sin = rotary_2d(grids, m, self.inv_freq, device)  # [N, head_dim] float32
        frames = _Segments([h * w for t, h, w in grids for _ in range(t)])
        if not self.config.window_size:
            for block in self.blocks:
                x = block(x, cos, sin, frames)
            merged = self.merger(x)
        else:
            order, window_lens = self._window_order(grids)
            order = order.to(device)
            windows = _Segments(window_lens)
            # Reorder whole merge units so that each window's patches are contiguous. Frames
            # stay contiguous too: windows never cross a frame.
            x, cos, sin = (_take_units(a, order, m2) for a in (x, cos, sin))
            full = set(self.config.fullatt_block_indexes)
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, frames if i in full else windows)
            merged = self.merger(x)[torch.argsort(order)]
        return list(merged.split([t * h * w // m2 for t, h, w in grids]))

    def _window_order(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Merge-unit order that makes windows contiguous, and each window's patch count."""
        cfg = self.config
        m = cfg.spatial_merge_size
        size = cfg.window_size // m // cfg.patch_size  # window side, in merged tokens
        order: list[torch.Tensor] = []
        lens: list[int] = []
        base = 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            units = torch.arange(t * gh * gw).view(t, gh, gw) + base
            for frame in units:
                for r in range(0, gh, size):
                    for c in range(0, gw, size):
                        window = frame[r : r + size, c : c + size].reshape(-1)
                        order.append(window)
                        lens.append(window.numel() * m * m)
            base += t * gh * gw
        return torch.cat(order), lens


def checked_grids(
    pixel_values: torch.Tensor, grid_thw: GridTHW, merge: int
) -> list[tuple[int, int, int]]:
    """The items' (t, h, w) patch grids as ints, checked against the packed patches: sides
    multiples of the merge size, one row of `pixel_values` per patch."""
    grids = [
        tuple(int(v) for v in g)
        for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)
    ]
    if any(h % merge or w % merge for _, h, w in grids):
        raise ValueError(f"grid sides must be multiples of the merge size {merge}: {grids}")
    if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
        raise ValueError(f"{pixel_values.shape[0]} patches for grids {grids}")
    return grids  # type: ignore[return-value]


def rotary_2d(
    grids: Sequence[tuple[int, int, int]],
    merge: int,
    inv_freq: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [N, head_dim] (float32) of the towers' 2-D rotary embedding: half the
    frequencies turn with each patch's row, half with its column; patches in merge-block
    order (h / m, w / m, m, m), the same per frame."""
    m = merge
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
        cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
    pos = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1).to(device)  # [N, 2]
    freqs = (pos[..., None].float() * inv_freq.to(device)).flatten(1)  # [N, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # NOTE: in float32 whatever the tower's dtype, as the reference.
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


def _take_units(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    return x.view(-1, unit, x.shape[-1])[order].reshape(-1, x.shape[-1])


class _Segments:
    """Packed sequences (frames or windows) that attend only within themselves."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        # Segments of equal length, by index: each group is one batched attention call.
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        self.groups = list(groups.values())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, head_dim] -> [N, heads, head_dim], non-causal per segment.
        Segments are split off and stacked, and the outputs concatenated back, rather than
        gathered and scattered by index: the same values, but in training each gather's
        backward is a zero tensor of all N tokens, one per group of segments (with a dozen
        picture sizes a step, 16% of the built-in model's tower forward and backward)."""
        parts = [a.split(self.lengths) for a in (q, k, v)]
        outs: dict[int, torch.Tensor] = {}
        for members in self.groups:
            # [segments, heads, length, head_dim]: all segments of one length in one call.
            qs, ks, vs = (torch.stack([p[i] for i in members]).transpose(1, 2) for p in parts)
            out = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
            for i, o in zip(members, out.unbind(0), strict=True):
                outs[i] = o
        return torch.cat([outs[i] for i in range(len(self.lengths))])
