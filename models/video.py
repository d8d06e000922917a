"""Video containers (MP4, WebM, MKV, MOV, anything FFmpeg reads) through PyAV.

Two steps, so a proxy can count placeholders without decoding a frame:

    probe(data)                 -> VideoHeader (stream frame count, rate, size) from the header
    decode_frames(data, idx)    -> the frames at those indices (decode order), as RGB images

The frame count comes from the stream's header (`nb_frames`); containers that do not record it
(Matroska / WebM) give it as duration x average rate, rounded. Decoding checks the count: a
container whose stream holds fewer frames than its header claims is truncated, and says so.
Every problem raises MediaError.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from models.media import MediaError

# PyAV logs FFmpeg's complaints about damaged streams; the MediaError says what matters.
logging.getLogger("libav").setLevel(logging.CRITICAL)


@dataclass(frozen=True)
class VideoHeader:
    total_num_frames: int
    fps: float
    width: int
    height: int
    codec: str


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise MediaError("video containers need PyAV (`pip install av`)") from e
    return av


def _open(data: bytes):
    av = _av()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MediaError(f"video must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise MediaError("video is empty (0 bytes)")
    try:
        return av.open(io.BytesIO(bytes(data)), mode="r")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(
            f"not a readable video container ({len(data)} bytes starting {bytes(data[:8])!r}): {e}"
        ) from None


def _stream(container):
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise MediaError(f"the container has no video stream (streams: {', '.join(kinds)})")
    return container.streams.video[0]


def probe(data: bytes) -> VideoHeader:
    """The video stream's frame count, rate and size, from the container's header alone."""
    with _open(data) as container:
        stream = _stream(container)
        rate = stream.average_rate or stream.base_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not (math.isfinite(fps) and fps > 0):
            raise MediaError("the video stream has no frame rate in its header")
        frames = int(stream.frames or 0)
        if frames <= 0:
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                seconds = container.duration / 1_000_000
            else:
                seconds = 0.0
            frames = round(seconds * fps)
        ctx = stream.codec_context
        width, height = int(ctx.width or 0), int(ctx.height or 0)
        if frames <= 0:
            raise MediaError("the video stream has no frames (its header records none)")
        if width <= 0 or height <= 0:
            raise MediaError(f"the video stream has no frame size in its header ({width}x{height})")
        return VideoHeader(frames, fps, width, height, ctx.name or "")


def decode_frames(data: bytes, indices: Sequence[int], expected_total: int) -> list[Image.Image]:
    """The frames at `indices` (ascending, in decode order) as RGB images. Stops decoding after
    the last one. MediaError when the stream ends first or a packet cannot be decoded."""
    av = _av()
    wanted = frozenset(indices)
    if not wanted:
        return []
    last = max(wanted)
    picked: dict[int, Image.Image] = {}
    count = 0
    with _open(data) as container:
        stream = _stream(container)
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                if count in wanted:
                    picked[count] = frame.to_image().convert("RGB")
                count += 1
                if count > last:
                    break
        except (av.FFmpegError, ValueError, OSError) as e:
            raise MediaError(f"video data is corrupt or truncated at frame {count}: {e}") from None
    if count == 0:
        raise MediaError(
            f"the video stream has no decodable frames (its header says {expected_total}; "
            "the data may be truncated)"
        )
    if count <= last:
        raise MediaError(
            f"the video is truncated: its header says {expected_total} frames, the stream "
            f"decodes {count}"
        )
    return [picked[i] for i in indices]
