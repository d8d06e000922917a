"""Test support: random checkpoints in the Hugging Face layout and the reference generation
path. Tests, benchmarks and `epd make-model` use it; no role server imports it."""

from models.testing.attention import ContiguousKVAttention
from models.testing.make import make_checkpoint
from models.testing.reference import ImageItem, ReferenceModel, VideoItem, generate

__all__ = [
    "ContiguousKVAttention",
    "ImageItem",
    "ReferenceModel",
    "VideoItem",
    "generate",
    "make_checkpoint",
]
