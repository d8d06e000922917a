"""Video containers (MP4, WebM, MKV, MOV, anything FFmpeg reads) through PyAV.

Two steps, so a proxy can count placeholders without decoding a frame:

    probe(data)                 -> VideoHeader (stream frame count, rate, size) from the header
    decode_frames(data, idx, ..., size)
                                -> the frames at those indices (decode order), as RGB images
                                   resized to `size` one by one as they are decoded

The frame count comes from the stream's header (`nb_frames`); containers that do not record it
(Matroska / WebM) give it as duration x average rate, rounded. Decoding checks the count: a
container whose stream holds fewer frames than its header claims is truncated, and says so.
Every problem raises MediaError.

A high-resolution stream compresses well (64 frames of 4096x4096 fit in a few MB), so frames are
never all kept at full size: each is resized with Pillow as soon as it is decoded, the same
resize the processor would do afterwards, and only the small image is kept.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from models.media import MediaError

if TYPE_CHECKING:
    import av

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


def decode_frames(
    data: bytes,
    indices: Sequence[int],
    expected_total: int,
    size: tuple[int, int] | None = None,
    resample: int = Image.Resampling.BICUBIC,
) -> list[Image.Image]:
    """The frames at `indices` (ascending, in decode order) as RGB images, each resized to
    `size` (width, height; None: kept as decoded) with Pillow's `resample` filter as soon as it
    is decoded, so one frame at a time is held at full size. Stops decoding after the last one.
    MediaError when a frame's size is not the header's, the stream ends first or a packet cannot
    be decoded."""
    av = _av()
    wanted = frozenset(indices)
    if not wanted:
        return []
    last = max(wanted)
    picked: dict[int, Image.Image] = {}
    count = 0
    with _open(data) as container:
        stream = _stream(container)
        ctx = stream.codec_context
        header_size = (int(ctx.width or 0), int(ctx.height or 0))
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                if count in wanted:
                    picked[count] = _fit(frame, header_size, size, resample)
                count += 1
                if count > last:
                    break
        except MediaError:
            raise
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


def _fit(
    frame: av.VideoFrame, header_size: tuple[int, int], size: tuple[int, int] | None, resample: int
) -> Image.Image:
    """One decoded frame as an RGB image of `size`: its full-size RGB copy lives only here."""
    if (frame.width, frame.height) != header_size:
        raise MediaError(
            f"a decoded frame is {frame.width}x{frame.height}; the header says "
            f"{header_size[0]}x{header_size[1]}"
        )
    # NOTE: the same rgb24 conversion as frame.to_image(), with one full-size copy, not three.
    image = Image.fromarray(frame.to_ndarray(format="rgb24"))  # [H, W, 3] uint8 -> RGB
    if size is None or image.size == tuple(size):
        return image
    return image.resize(tuple(size), resample=Image.Resampling(resample))
