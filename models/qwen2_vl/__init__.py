"""Qwen2-VL and Qwen2.5-VL: images and video through one vision tower, the Qwen2 LM, M-RoPE."""

from models.qwen2_vl.family import Qwen2VLFamily

__all__ = ["Qwen2VLFamily"]
