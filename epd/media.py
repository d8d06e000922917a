"""Media items inside the cluster: the one conversion of a proto `MediaItem` to plain data.

    epd.v1.MediaItem --media_from_proto--> MediaInput --media_grid--> MediaGrid (header only)
                                                      --preprocess_media--> ProcessedMedia

The proxy (hashing, placeholder counts from headers) and the encoder worker (preprocessing)
both start from `MediaInput`, so they read a request's items the same way: the same bytes, the
same processor kwargs (numbers normalised the same way), the same uuid. Nothing here knows
about encoders, caches or hashing.

Every problem with an item raises `models.MediaError`; the servers map it to INVALID_ARGUMENT
for that item alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format

from models import MediaError, MediaGrid, MediaProcessor, ProcessedMedia
from proto import epd_pb2

Modality = Literal["image", "video", "audio"]
AudioFormat = Literal["wav", "pcm_s16le", "pcm_f32le"]

_AUDIO_FORMATS: dict[int, AudioFormat] = {
    epd_pb2.AUDIO_FORMAT_WAV: "wav",
    epd_pb2.AUDIO_FORMAT_PCM_S16LE: "pcm_s16le",
    epd_pb2.AUDIO_FORMAT_PCM_F32LE: "pcm_f32le",
}

NO_AUDIO_ENCODER = "audio items need an audio encoder; this model has none"


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
            return sum(len(f) for f in self.frames)
        return len(self.audio.data) if self.audio is not None else 0


def media_from_proto(msg: epd_pb2.MediaItem) -> MediaInput:
    """The MediaInput of a proto MediaItem. MediaError when it has no payload."""
    kind = msg.WhichOneof("payload")
    kwargs = _plain(json_format.MessageToDict(msg.processor_kwargs))
    common = {"kwargs": kwargs, "uuid": msg.uuid}
    if kind == "image":
        return MediaInput("image", image=msg.image, **common)
    if kind == "video":
        return MediaInput("video", frames=tuple(msg.video.frames), fps=msg.video.fps, **common)
    if kind == "audio":
        clip = msg.audio
        fmt = _AUDIO_FORMATS.get(clip.format)
        if fmt is None:
            raise MediaError(f"unknown audio format {clip.format}")
        if fmt != "wav" and clip.sample_rate == 0:
            raise MediaError(f"{fmt} audio needs its sample_rate")
        return MediaInput("audio", audio=AudioClip(clip.data, fmt, clip.sample_rate), **common)
    raise MediaError("media item has no payload: set one of image, video or audio")


def media_to_proto(item: MediaInput) -> epd_pb2.MediaItem:
    """The inverse of media_from_proto (the proxy forwards items to encoders with it)."""
    msg = epd_pb2.MediaItem(uuid=item.uuid)
    if item.kwargs:
        json_format.ParseDict(item.kwargs, msg.processor_kwargs)
    if item.modality == "image":
        msg.image = item.image
    elif item.modality == "video":
        msg.video.frames.extend(item.frames)
        msg.video.fps = item.fps
    elif item.audio is not None:
        fmt = {v: k for k, v in _AUDIO_FORMATS.items()}[item.audio.format]
        msg.audio.CopyFrom(
            epd_pb2.AudioClip(data=item.audio.data, format=fmt, sample_rate=item.audio.sample_rate)
        )
    return msg


def media_grid(processor: MediaProcessor, item: MediaInput) -> MediaGrid:
    """The item's patch grid and placeholder count, from its header(s) alone."""
    if item.modality == "image":
        return processor.image_grid(item.image, item.kwargs)
    if item.modality == "video":
        return processor.video_grid(item.frames, item.fps, item.kwargs)
    raise MediaError(NO_AUDIO_ENCODER)


def preprocess_media(processor: MediaProcessor, item: MediaInput) -> ProcessedMedia:
    """Decode and preprocess the item into the tower's input (CPU work: run it off the event
    loop)."""
    if item.modality == "image":
        return processor.process_image(item.image, item.kwargs)
    if item.modality == "video":
        return processor.process_video(item.frames, item.fps, item.kwargs)
    raise MediaError(NO_AUDIO_ENCODER)


def _plain(value: Any) -> Any:
    """protobuf Struct data -> plain data: every Struct number is a double, so integral ones
    become ints (min_pixels: 3136, not 3136.0), the same on every role."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


__all__ = [
    "NO_AUDIO_ENCODER",
    "AudioClip",
    "MediaInput",
    "media_from_proto",
    "media_grid",
    "media_to_proto",
    "preprocess_media",
]
