"""Media items as every family and every role sees them, whatever the model.

    MediaInput (raw bytes, as the client sent them)
      --processor.grid--> MediaGrid (from the header alone: how many placeholder tokens)
      --processor.preprocess--> ProcessedMedia (the encoder's input)
      --encoder--> embeddings [num_tokens, width], published under the item's mm_hash
    MMFeature: where one item's embeddings go in a prompt (what the LM gathers by)

Every problem with an item's bytes or settings raises `MediaError`; servers map it to
INVALID_ARGUMENT for that item alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

Modality = Literal["image", "video", "audio"]
AudioFormat = Literal["wav", "pcm_s16le", "pcm_f32le"]


class MediaError(ValueError):
    """Media bytes or per-item settings we cannot use. `reason` says what is wrong."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class AudioClip:
    data: bytes
    format: AudioFormat
    sample_rate: int  # Hz; 0 for WAV (its header says)


@dataclass(frozen=True)
class MediaInput:
    """One media item exactly as the client sent it: raw bytes, never decoded here."""

    modality: Modality
    image: bytes = b""  # image: one encoded image
    frames: tuple[bytes, ...] = ()  # video: one encoded image per frame, in order
    fps: float = 0.0  # video: sampling rate of `frames`
    # video: a whole container file (MP4, WebM, MKV, MOV), sampled by the family's processor
    # (its settings, e.g. fps / min_frames / max_frames, go in `kwargs`). Exclusive with frames.
    video: bytes = b""
    audio: AudioClip | None = None  # audio
    # Per-item processor kwargs (min_pixels, max_pixels, size) as plain data; integral numbers
    # are ints. Part of the item's hash.
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    # Client identity; when set it replaces the content hash as the cache key.
    uuid: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of media the item carries."""
        if self.modality == "image":
            return len(self.image)
        if self.modality == "video":
            return len(self.video) + sum(len(f) for f in self.frames)
        return len(self.audio.data) if self.audio is not None else 0


@dataclass(frozen=True)
class VideoMetadata:
    """How a video container was sampled (transformers' `video_metadata`), from its header."""

    total_num_frames: int  # frames in the container's video stream
    fps: float  # the stream's frame rate
    width: int
    height: int
    frames_indices: tuple[int, ...]  # the sampled frames, in order
    codec: str = ""

    @property
    def duration(self) -> float:
        """Seconds the stream covers."""
        return self.total_num_frames / self.fps

    @property
    def timestamps(self) -> tuple[float, ...]:
        """Seconds at which each sampled frame is shown."""
        return tuple(i / self.fps for i in self.frames_indices)

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled clip."""
        return len(self.frames_indices) / self.total_num_frames * self.fps


@dataclass(frozen=True)
class MediaRun:
    """The tokens an item stands for in the prompt when that is not its placeholder repeated
    `num_tokens` times: Qwen3-VL's video, each temporal patch's frames as
    `<t seconds><|vision_start|>` placeholders `<|vision_end|>`. The run replaces the item's
    placeholder together with the `before` / `after` tokens the chat template put around it
    (its own markers); only the `is_embed` tokens take embeddings, in order."""

    tokens: tuple[int, ...]
    is_embed: tuple[bool, ...]  # one flag per token; sum == the grid's num_tokens
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class MediaGrid:
    """What an item becomes, known from its header: its placeholder count and patch grid."""

    modality: Modality
    grid_thw: tuple[int, int, int]  # patches along (time, height, width)
    num_tokens: int  # placeholder tokens the item expands to (the embeddings it takes)
    # Video only: seconds covered by one temporal patch.
    second_per_grid_t: float | None = None
    # Video containers only: the sampled frames.
    video_metadata: VideoMetadata | None = None
    # Placeholder tokens before pruning (EVS keeps `num_tokens` of them); 0: not pruned.
    num_unpruned_tokens: int = 0
    # Set where the prompt holds more than the placeholders for the item (MediaRun).
    run: MediaRun | None = None

    @property
    def expansion(self) -> MediaRun | int:
        """What the item's placeholder becomes in the prompt (models.expand_media): its run,
        or its placeholder repeated num_tokens times."""
        return self.run or self.num_tokens

    @property
    def encoder_tokens(self) -> int:
        """Embeddings the encoder computes for the item (before any pruning): its work."""
        return self.num_unpruned_tokens or self.num_tokens

    # Audio only: the clip's length in seconds (from its header).
    seconds: float | None = None


@dataclass(frozen=True)
class ProcessedMedia:
    grid: MediaGrid
    pixel_values: torch.Tensor  # the encoder's input for this item (for images: patches)


@dataclass(frozen=True)
class MMFeature:
    """Where one media item's embeddings go in the prompt (vLLM's PlaceholderRange + hash)."""

    mm_hash: str
    offset: int  # first placeholder token
    length: int  # placeholder tokens
    # One flag per placeholder token; None: every placeholder token takes an embedding.
    is_embed: np.ndarray | None = None  # [length] bool
    modality: Modality = "image"
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_t: float | None = None

    def __post_init__(self):
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(
                f"{self.mm_hash}: is_embed has {len(self.is_embed)} flags for {self.length} tokens"
            )

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    def embeds_in_range(self, start: int, end: int) -> tuple[int, int]:
        """Embedding rows [lo, hi) that placeholder tokens [start, end) (item-relative) take."""
        if self.is_embed is None:
            return start, end
        lo = int(self.is_embed[:start].sum())
        return lo, lo + int(self.is_embed[start:end].sum())
