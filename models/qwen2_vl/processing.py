"""Image and video preprocessing for the Qwen2-VL family, numerically equal to the reference.

The reference is transformers' `Qwen2VLImageProcessorPil`: convert to RGB (compositing any
transparency onto white), resize with Pillow to a `smart_resize` size (sides multiples of
patch_size * merge_size, pixel count within [min_pixels, max_pixels]), rescale in float64 then
cast to float32, normalize in float32, and cut into patches of temporal_patch_size frames.

`pixel_values` rows are patches in merge-block order (grid_t, h / m, w / m, m, m); each row is
the (channel, frame, row, column) flattening of one patch: C * T * P * P values. A still image is
a clip of T copies of itself; a video whose frame count is not a multiple of T repeats its last
frame.

The grid (and so the placeholder count) of an item needs only its header: the proxy calls
`MediaProcessor.image_grid` before any decoding. Every problem with the bytes raises
`MediaError`, which the servers map to INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from models import video as containers
from models.checkpoint import CheckpointError
from models.media import MediaError, MediaGrid, MediaInput, ProcessedMedia, VideoMetadata
from models.qwen2_vl.config import ProcessorConfig, load_processor_configs
from models.qwen2_vl.evs import retained_count

VisionModality = Literal["image", "video"]

# Our own decompression-bomb limit, checked on the header before any pixel is decoded.
# NOTE: keep it under twice Pillow's global MAX_IMAGE_PIXELS (179 MP), where Pillow refuses too.
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024
DEFAULT_MAX_FRAMES = 768
DEFAULT_MAX_VIDEO_SECONDS = 3600.0
# The reference refuses more extreme shapes in smart_resize.
MAX_ASPECT_RATIO = 200
# Processor kwargs a request may set per item.
ITEM_KWARGS = frozenset({"min_pixels", "max_pixels", "size"})
# ... and for a video container, how its frames are sampled.
VIDEO_KWARGS = ITEM_KWARGS | {"fps", "min_frames", "max_frames"}


def sample_frame_indices(total: int, source_fps: float, cfg: ProcessorConfig) -> list[int]:
    """The frames a container's stream is sampled at, as transformers' Qwen2-VL video processor
    picks them: `fps` frames per second of video, clamped to [min_frames, max_frames] and to the
    stream, a multiple of temporal_patch_size, spread evenly from frame 0."""
    t = cfg.temporal_patch_size
    max_frames = math.floor(min(cfg.max_frames, total) / t) * t
    wanted = min(max(total / source_fps * cfg.fps, cfg.min_frames), max_frames, total)
    num_frames = math.floor(wanted / t) * t
    if num_frames <= 0:
        raise MediaError(
            f"the video has {total} frames; sampling needs at least {t} (temporal_patch_size)"
        )
    # NOTE: float32 steps truncated toward zero, exactly as the reference computes them.
    return torch.arange(0, total, total / num_frames).int().tolist()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The resized (height, width): multiples of `factor`, within the pixel budget, aspect kept."""
    if min(height, width) <= 0:
        raise MediaError(f"image has a zero side ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is above "
            f"{MAX_ASPECT_RATIO} ({width}x{height})"
        )
    # NOTE: Python's round() (half to even), as the reference.
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class MediaProcessor:
    """One checkpoint's image and video preprocessing, with the per-item kwargs it honours."""

    def __init__(
        self,
        image_config: ProcessorConfig,
        video_config: ProcessorConfig,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
        video_pruning_rate: float = 0.0,
    ):
        self.image_config = image_config
        self.video_config = video_config
        self.max_image_pixels = max_image_pixels
        self.max_frames = max_frames  # frames a video may bring to the tower
        self.max_video_seconds = max_video_seconds  # a container's duration
        self.video_pruning_rate = video_pruning_rate  # EVS (0: off)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **limits: int) -> MediaProcessor:
        image, video = load_processor_configs(checkpoint_dir)
        return cls(image, video, **limits)

    # -- what the roles call (models.family.MediaProcessor) -------------------------------------

    def grid(self, item: MediaInput) -> MediaGrid:
        """The item's patch grid and placeholder count, from its header(s) alone."""
        if item.modality == "image":
            return self.image_grid(item.image, item.kwargs)
        if item.modality == "video":
            if item.video:
                return self.video_file_grid(item.video, item.kwargs)
            return self.video_grid(item.frames, item.fps, item.kwargs)
        raise MediaError(f"{item.modality} items: this model takes images and video")

    def preprocess(self, item: MediaInput) -> ProcessedMedia:
        """Decode and preprocess the item into the tower's input (CPU work, thread-safe)."""
        if item.modality == "image":
            return self.process_image(item.image, item.kwargs)
        if item.modality == "video":
            if item.video:
                return self.process_video_file(item.video, item.kwargs)
            return self.process_video(item.frames, item.fps, item.kwargs)
        raise MediaError(f"{item.modality} items: this model takes images and video")

    def warmup_item(self) -> MediaInput:
        """A small synthetic image: what an encoder runs once before it says SERVING."""
        side = 2 * self.image_config.factor
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (127, 127, 127)).save(buf, "PNG")
        return MediaInput("image", image=buf.getvalue())

    # -- header only ---------------------------------------------------------------------------

    def image_grid(self, data: bytes, kwargs: dict[str, Any] | None = None) -> MediaGrid:
        """The grid and placeholder count of an encoded image, from its header alone."""
        cfg = self._config("image", kwargs)
        with self._open(data) as image:
            width, height = image.size
        return self._grid("image", 1, height, width, cfg)

    def picture_grid(self, image: Image.Image, kwargs: dict[str, Any] | None = None) -> MediaGrid:
        """image_grid of a picture in memory (process_picture's), from its size alone."""
        return self._grid("image", 1, image.height, image.width, self._config("image", kwargs))

    def video_grid(
        self, frames: Sequence[bytes], fps: float, kwargs: dict[str, Any] | None = None
    ) -> MediaGrid:
        """The grid and placeholder count of a video given as encoded frames, from headers."""
        cfg = self._config("video", kwargs)
        self._check_video(frames, fps)
        sizes = set()
        for data in frames:
            with self._open(data) as image:
                sizes.add(image.size)
        if len(sizes) != 1:
            raise MediaError(f"video frames differ in size: {sorted(sizes)}")
        ((width, height),) = sizes
        return self._grid("video", len(frames), height, width, cfg, fps)

    def video_file_grid(self, data: bytes, kwargs: dict[str, Any] | None = None) -> MediaGrid:
        """The grid and placeholder count of a video container, from its header alone: the
        stream's frame count, rate and size decide the sampled frames and their size."""
        cfg = self._config("video", kwargs, allowed=VIDEO_KWARGS)
        header = containers.probe(data)
        seconds = header.total_num_frames / header.fps
        if seconds > self.max_video_seconds:
            raise MediaError(
                f"the video is {seconds:.1f} s long, above the limit of "
                f"{self.max_video_seconds:g} s"
            )
        if header.width * header.height > self.max_image_pixels:
            raise MediaError(
                f"video frames are {header.width}x{header.height} = "
                f"{header.width * header.height} pixels, above the limit of "
                f"{self.max_image_pixels} (decompression bomb protection)"
            )
        indices = self._sample_frames(header.total_num_frames, header.fps, cfg)
        if len(indices) > self.max_frames:
            raise MediaError(
                f"the video samples to {len(indices)} frames, more than {self.max_frames}"
            )
        metadata = VideoMetadata(
            header.total_num_frames,
            header.fps,
            header.width,
            header.height,
            tuple(indices),
            header.codec,
        )
        grid = self._grid(
            "video", len(indices), header.height, header.width, cfg, metadata.sampled_fps
        )
        return replace(grid, video_metadata=metadata)

    # -- full preprocessing --------------------------------------------------------------------

    def process_image(self, data: bytes, kwargs: dict[str, Any] | None = None) -> ProcessedMedia:
        cfg = self._config("image", kwargs)
        return self._image_media(self._decode(data), cfg)  # _decode checks the header first

    def process_picture(
        self, image: Image.Image, kwargs: dict[str, Any] | None = None
    ) -> ProcessedMedia:
        """process_image of a picture already in memory (training draws its own): the same
        pixels as its lossless encoding would give, without the encode and decode."""
        return self._image_media(to_rgb(image), self._config("image", kwargs))

    def _image_media(self, rgb: Image.Image, cfg: ProcessorConfig) -> ProcessedMedia:
        grid = self._grid("image", 1, rgb.height, rgb.width, cfg)
        return ProcessedMedia(grid, _pixel_values([rgb], grid, cfg))

    def process_video(
        self, frames: Sequence[bytes], fps: float, kwargs: dict[str, Any] | None = None
    ) -> ProcessedMedia:
        grid = self.video_grid(frames, fps, kwargs)  # checks every frame's header first
        cfg = self._config("video", kwargs)
        # Frames are decoded one at a time and resized at once: only resized ones are kept.
        decoded = (self._decode(data) for data in frames)
        return ProcessedMedia(grid, _pixel_values(decoded, grid, cfg))

    def process_video_file(
        self, data: bytes, kwargs: dict[str, Any] | None = None
    ) -> ProcessedMedia:
        grid = self.video_file_grid(data, kwargs)
        cfg = self._config("video", kwargs, allowed=VIDEO_KWARGS)
        meta = grid.video_metadata
        # Each frame is resized as it is decoded (the resize _pixel_values would do): a
        # high-resolution stream is never held at full size frame after frame.
        frames = containers.decode_frames(
            data, meta.frames_indices, meta.total_num_frames, _frame_size(grid, cfg), cfg.resample
        )
        return ProcessedMedia(grid, _pixel_values(frames, grid, cfg))

    # -- helpers -------------------------------------------------------------------------------

    def _config(
        self,
        modality: VisionModality,
        kwargs: dict[str, Any] | None,
        allowed: frozenset[str] = ITEM_KWARGS,
    ) -> ProcessorConfig:
        base = self.image_config if modality == "image" else self.video_config
        if not kwargs:
            return base
        unknown = set(kwargs) - allowed
        size = kwargs.get("size")
        if isinstance(size, dict):
            unknown |= {f"size.{k}" for k in set(size) - {"shortest_edge", "longest_edge"}}
        if unknown:
            raise MediaError(
                f"unknown {modality} processor kwargs {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        try:
            return base.with_overrides(kwargs)
        except (CheckpointError, TypeError, ValueError) as e:
            raise MediaError(f"bad {modality} processor kwargs {kwargs}: {e}") from e

    def _sample_frames(self, total: int, source_fps: float, cfg: ProcessorConfig) -> list[int]:
        """The frames of a container's stream to take (the family's sampling rule)."""
        return sample_frame_indices(total, source_fps, cfg)

    def _resized(
        self, modality: VisionModality, num_frames: int, height: int, width: int, cfg
    ) -> tuple[int, int]:
        """The (height, width) the item's frames are resized to (the family's rule)."""
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)

    def _check_video(self, frames: Sequence[bytes], fps: float) -> None:
        if not frames:
            raise MediaError("video has no frames")
        if len(frames) > self.max_frames:
            raise MediaError(f"video has {len(frames)} frames, more than {self.max_frames}")
        if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
            raise MediaError(f"video fps must be a positive number, got {fps!r}")

    def _grid(
        self,
        modality: VisionModality,
        num_frames: int,
        height: int,
        width: int,
        cfg: ProcessorConfig,
        fps: float | None = None,
    ) -> MediaGrid:
        if cfg.do_resize:
            height, width = self._resized(modality, num_frames, height, width, cfg)
        elif height % cfg.factor or width % cfg.factor:
            raise MediaError(
                f"with resizing off, sides must be multiples of {cfg.factor}, got {width}x{height}"
            )
        t = cfg.temporal_patch_size
        grid = (-(-num_frames // t), height // cfg.patch_size, width // cfg.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // cfg.merge_size**2
        second_per_grid_t = t / fps if fps is not None else None
        if modality == "video" and self.video_pruning_rate > 0:
            kept = retained_count(grid, cfg.merge_size, self.video_pruning_rate)
            return MediaGrid(modality, grid, kept, second_per_grid_t, num_unpruned_tokens=tokens)
        return MediaGrid(modality, grid, tokens, second_per_grid_t)

    def _open(self, data: bytes) -> Image.Image:
        """Open (header only) and check the size against the decompression-bomb limit."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MediaError(f"media must be bytes, got {type(data).__name__}")
        if len(data) == 0:
            raise MediaError("media is empty (0 bytes)")
        try:
            with warnings.catch_warnings():
                # Our limit decides (below); Pillow's hard limit (2x its global) still applies.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise MediaError(f"image is too large (decompression bomb protection): {e}") from e
        except Image.UnidentifiedImageError:
            raise MediaError(
                f"not a recognised image format ({len(data)} bytes starting {bytes(data[:8])!r})"
            ) from None
        except (OSError, ValueError, SyntaxError) as e:
            raise MediaError(f"unreadable image header: {e}") from e
        width, height = image.size
        if width <= 0 or height <= 0:
            image.close()
            raise MediaError(f"image has a zero side ({width}x{height})")
        if width * height > self.max_image_pixels:
            image.close()
            raise MediaError(
                f"image is {width}x{height} = {width * height} pixels, above the limit of "
                f"{self.max_image_pixels} (decompression bomb protection)"
            )
        return image

    def _decode(self, data: bytes) -> Image.Image:
        """Decode fully and convert to RGB the way the reference does."""
        image = self._open(data)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image.load()
                return to_rgb(image)
        except MediaError:
            raise
        except Exception as e:  # Pillow raises many types for corrupt data
            raise MediaError(f"image data is corrupt or truncated: {e}") from e
        finally:
            image.close()


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto a white background (as the reference)."""
    # NOTE: the reference treats any band named "A" as alpha, so LAB images take this path too.
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _frame_size(grid: MediaGrid, cfg: ProcessorConfig) -> tuple[int, int]:
    """The (width, height) every frame of the item is resized to."""
    _, grid_h, grid_w = grid.grid_thw
    return grid_w * cfg.patch_size, grid_h * cfg.patch_size


def _pixel_values(
    frames: Iterable[Image.Image], grid: MediaGrid, cfg: ProcessorConfig
) -> torch.Tensor:
    size = _frame_size(grid, cfg)
    arrays = []
    for frame in frames:
        if frame.size != size:
            frame = frame.resize(size, resample=Image.Resampling(cfg.resample))
        arrays.append(np.asarray(frame))  # [H, W, 3] uint8
    stacked = np.stack(arrays)
    # A picture is one frame that every patch holds T times: look each byte up once.
    t = cfg.temporal_patch_size if len(stacked) > 1 else 1
    # Patches are cut from the bytes (a quarter of the float32 data to move), then each byte
    # becomes its channel's value through a table: the same float32 numbers as computing
    # them pixel by pixel.
    patches = patchify(stacked, cfg, t)  # [N, C * t * P * P] uint8, channel first
    channels = patches.shape[1] // (t * cfg.patch_size**2)
    table = _value_table(cfg, channels)  # [C, 256]
    by_channel = patches.reshape(len(patches), channels, -1)
    values = np.empty(by_channel.shape, np.float32)
    for c in range(channels):
        np.take(table[c], by_channel[:, c], out=values[:, c])
    if t != cfg.temporal_patch_size:
        values = np.repeat(values[:, :, None], cfg.temporal_patch_size, axis=2)
    return torch.from_numpy(values.reshape(len(patches), -1))


def _value_table(cfg: ProcessorConfig, channels: int) -> np.ndarray:
    """[channels, 256] float32: each byte value's rescaled, normalized value per channel."""
    x = np.repeat(np.arange(256, dtype=np.uint8)[:, None], channels, axis=1)  # [256, C]
    if cfg.do_rescale:
        # NOTE: float64 multiply then float32, exactly as the reference rounds.
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.T)


def patchify(frames: np.ndarray, cfg: ProcessorConfig, t: int | None = None) -> np.ndarray:
    """[F, H, W, C] frames -> [grid_t * grid_h * grid_w, C * T * P * P] patches, T frames a
    patch (t, default cfg.temporal_patch_size)."""
    t, m, p = t or cfg.temporal_patch_size, cfg.merge_size, cfg.patch_size
    if pad := -len(frames) % t:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    num_frames, height, width, channels = frames.shape
    gt, gh, gw = num_frames // t, height // p, width // p
    x = frames.reshape(gt, t, gh // m, m, p, gw // m, m, p, channels)
    # -> (gt, gh/m, gw/m, m_h, m_w, C, T, P_h, P_w)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, channels * t * p * p))
