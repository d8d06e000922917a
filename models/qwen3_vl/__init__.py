"""Qwen3-VL, dense and MoE: images through a vision tower with deepstack levels, the Qwen3 LM
with interleaved M-RoPE."""

from models.qwen3_vl.family import Qwen3VLFamily

__all__ = ["Qwen3VLFamily"]
