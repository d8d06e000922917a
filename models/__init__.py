"""Model families in our own PyTorch, loading checkpoints in the Hugging Face layout.

The roles use only this surface: `load_family(path)` gives the checkpoint's family
(models/family.py says what it offers), plus the media types every family shares.

    registry.py    config.json architectures -> family (one line per family)
    family.py      the interface: ModelFamily, ModelState, MediaProcessor, MediaEncoder
    media.py       MediaInput, MediaGrid, ProcessedMedia, MMFeature, MediaError
    qwen2_vl/      Qwen2-VL and Qwen2.5-VL
    qwen3_vl/      Qwen3-VL, dense and MoE
    testing/       random checkpoints and the reference path (tests and benchmarks only)
"""

from models.checkpoint import CheckpointError
from models.family import (
    EmbeddingMismatch,
    FamilyOptions,
    LoadedEmbedding,
    ModelFamily,
    ModelState,
    TextDims,
)
from models.media import (
    AudioClip,
    MediaError,
    MediaGrid,
    MediaInput,
    MediaRun,
    MMFeature,
    Modality,
    ProcessedMedia,
    VideoMetadata,
)
from models.registry import load_family
from models.sampling import SamplingParams
from models.tokenizer import IncrementalDetokenizer, Tokenizer, expand_media, expand_placeholders

__all__ = [
    "AudioClip",
    "CheckpointError",
    "EmbeddingMismatch",
    "FamilyOptions",
    "IncrementalDetokenizer",
    "LoadedEmbedding",
    "MMFeature",
    "MediaError",
    "MediaGrid",
    "MediaInput",
    "MediaRun",
    "Modality",
    "ModelFamily",
    "ModelState",
    "ProcessedMedia",
    "SamplingParams",
    "TextDims",
    "Tokenizer",
    "VideoMetadata",
    "expand_media",
    "expand_placeholders",
    "load_family",
]
