"""Media items on the wire: the one conversion between a proto `MediaItem` and
`models.MediaInput`, and the proto enum of each modality.

The proxy (hashing, placeholder counts from headers) and the encoder worker (preprocessing)
both start from `MediaInput`, so they read a request's items the same way: the same bytes, the
same processor kwargs (numbers normalised the same way), the same uuid. What an item becomes is
the model family's business (its processor); nothing here knows a model.

A proto item that cannot be read raises `models.MediaError`; the servers map it to
INVALID_ARGUMENT for that item alone.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import json_format

from models import AudioClip, MediaError, MediaInput, Modality
from models.media import AudioFormat
from proto import epd_pb2

MODALITIES: dict[Modality, int] = {
    "image": epd_pb2.MODALITY_IMAGE,
    "video": epd_pb2.MODALITY_VIDEO,
    "audio": epd_pb2.MODALITY_AUDIO,
}
MODALITY_NAMES: dict[int, Modality] = {v: k for k, v in MODALITIES.items()}

_AUDIO_FORMATS: dict[int, AudioFormat] = {
    epd_pb2.AUDIO_FORMAT_WAV: "wav",
    epd_pb2.AUDIO_FORMAT_PCM_S16LE: "pcm_s16le",
    epd_pb2.AUDIO_FORMAT_PCM_F32LE: "pcm_f32le",
}


def media_from_proto(msg: epd_pb2.MediaItem) -> MediaInput:
    """The MediaInput of a proto MediaItem. MediaError when it has no payload."""
    kind = msg.WhichOneof("payload")
    kwargs = _plain(json_format.MessageToDict(msg.processor_kwargs))
    common = {"kwargs": kwargs, "uuid": msg.uuid}
    if kind == "image":
        return MediaInput("image", image=msg.image, **common)
    if kind == "video":
        return MediaInput("video", frames=tuple(msg.video.frames), fps=msg.video.fps, **common)
    if kind == "video_file":
        return MediaInput("video", video=msg.video_file, **common)
    if kind == "audio":
        clip = msg.audio
        fmt = _AUDIO_FORMATS.get(clip.format)
        if fmt is None:
            raise MediaError(f"unknown audio format {clip.format}")
        if fmt != "wav" and clip.sample_rate == 0:
            raise MediaError(f"{fmt} audio needs its sample_rate")
        return MediaInput("audio", audio=AudioClip(clip.data, fmt, clip.sample_rate), **common)
    raise MediaError("media item has no payload: set one of image, video, video_file or audio")


def media_to_proto(item: MediaInput) -> epd_pb2.MediaItem:
    """The inverse of media_from_proto (the proxy forwards items to encoders with it)."""
    msg = epd_pb2.MediaItem(uuid=item.uuid)
    if item.kwargs:
        json_format.ParseDict(item.kwargs, msg.processor_kwargs)
    if item.modality == "image":
        msg.image = item.image
    elif item.modality == "video" and item.video:
        msg.video_file = item.video
    elif item.modality == "video":
        msg.video.frames.extend(item.frames)
        msg.video.fps = item.fps
    elif item.audio is not None:
        fmt = {v: k for k, v in _AUDIO_FORMATS.items()}[item.audio.format]
        msg.audio.CopyFrom(
            epd_pb2.AudioClip(data=item.audio.data, format=fmt, sample_rate=item.audio.sample_rate)
        )
    return msg


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


__all__ = ["MODALITIES", "MODALITY_NAMES", "media_from_proto", "media_to_proto"]
