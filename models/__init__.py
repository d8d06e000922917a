"""Model code both worker roles import: checkpoints, preprocessing, towers and LMs.

Families: Qwen2-VL and Qwen2.5-VL, loaded from checkpoints in the Hugging Face layout.

- proxy:   `Tokenizer`, `MediaProcessor.image_grid / video_grid` (headers only),
           `expand_placeholders`, `model_fingerprint`, `MediaError`
- encoder: `MediaProcessor.process_image / process_video`, `VisionTower.embed_multimodal`
- LM:      `Qwen2LanguageModel` behind an `AttentionBackend`, `mrope_positions`
- tests:   `ReferenceModel` (the whole path, end to end), `make_checkpoint`
"""

from models.attention import AttentionBackend, ContiguousKVAttention
from models.builtin import ensure_builtin_model
from models.checkpoint import load_tensors, model_fingerprint
from models.config import (
    CheckpointError,
    ModelArchConfig,
    ProcessorConfig,
    load_arch_config,
    load_processor_configs,
)
from models.make import make_checkpoint
from models.processing import MediaError, MediaGrid, MediaProcessor, ProcessedMedia
from models.qwen2 import Qwen2LanguageModel
from models.reference import ImageItem, ReferenceModel, SamplingParams, VideoItem, generate
from models.rope import MediaSpan, mrope_decode_positions, mrope_positions
from models.tokenizer import IncrementalDetokenizer, Tokenizer, expand_placeholders
from models.vision import VisionTower

__all__ = [
    "AttentionBackend",
    "CheckpointError",
    "ContiguousKVAttention",
    "ImageItem",
    "IncrementalDetokenizer",
    "MediaError",
    "MediaGrid",
    "MediaProcessor",
    "MediaSpan",
    "ModelArchConfig",
    "ProcessedMedia",
    "ProcessorConfig",
    "Qwen2LanguageModel",
    "ReferenceModel",
    "SamplingParams",
    "Tokenizer",
    "VideoItem",
    "VisionTower",
    "ensure_builtin_model",
    "expand_placeholders",
    "generate",
    "load_arch_config",
    "load_processor_configs",
    "load_tensors",
    "make_checkpoint",
    "model_fingerprint",
    "mrope_decode_positions",
    "mrope_positions",
]
