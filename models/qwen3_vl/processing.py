"""Qwen3-VL preprocessing: images as Qwen2-VL's processor does them (16-pixel patches, mean and
std 0.5 by default), video as transformers' `Qwen3VLVideoProcessor` samples and sizes it,
with the prompt run `Qwen3VLProcessor` writes for it.

Video, against Qwen2-VL (models/qwen2_vl/processing.py):

- sampling: `fps` frames per second of the stream, clamped to [min_frames, max_frames] and
  to the stream, spread by `linspace(0, total - 1)` rounded half to even (not a multiple of
  temporal_patch_size: patchify repeats the last frame);
- sizing: the pixel budget (`size.longest_edge` / `shortest_edge`) is the whole clip's, so
  more frames get smaller frames;
- the prompt: each temporal patch's frames stand as `<{t:.1f} seconds>`, then
  `<|vision_start|>`, its placeholders, `<|vision_end|>`, where t is the mean of the patch's
  first and last frame times. That run replaces the template's
  `<|vision_start|><|video_pad|><|vision_end|>` (a MediaRun on the grid, known from the
  container's header, so the proxy builds the prompt without decoding a frame).

NOTE: each timestamp is tokenized on its own. transformers replaces the text and tokenizes
the whole prompt, which gives the same tokens whenever the text before the video ends in a
newline or a special token (as chat templates put it); text ending in a space or punctuation
right before a video could merge with the first `<` there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from models.media import MediaError, MediaGrid, MediaRun
from models.qwen2_vl.config import ProcessorConfig, load_processor_configs
from models.qwen2_vl.processing import MAX_ASPECT_RATIO, MediaProcessor, VisionModality

# transformers' Qwen3-VL defaults, for what a checkpoint's files leave out.
HALF = (0.5, 0.5, 0.5)
IMAGE_DEFAULTS = ProcessorConfig(patch_size=16, image_mean=HALF, image_std=HALF)
VIDEO_DEFAULTS = ProcessorConfig(
    patch_size=16,
    image_mean=HALF,
    image_std=HALF,
    min_pixels=128 * 32 * 32,
    max_pixels=32 * 32 * 768,
    fps=2.0,
    min_frames=4,
    max_frames=768,
)


def sample_frame_indices(total: int, source_fps: float, cfg: ProcessorConfig) -> list[int]:
    """The frames of a stream transformers' Qwen3-VL video processor samples."""
    num = int(total / source_fps * cfg.fps)
    num = min(max(num, cfg.min_frames), cfg.max_frames, total)
    if num < 1:
        raise MediaError("the video has no frames to sample")
    # NOTE: numpy's round (half to even), as the reference.
    return np.linspace(0, total - 1, num).round().astype(int).tolist()


def video_resize(num_frames: int, height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    """The (height, width) of a clip's frames: multiples of patch x merge, the whole clip
    (frames rounded to temporal patches) within [min_pixels, max_pixels]."""
    factor, t = cfg.factor, cfg.temporal_patch_size
    if num_frames < t:
        raise MediaError(f"the video has {num_frames} frames; it needs at least {t}")
    if min(height, width) <= 0:
        raise MediaError(f"video frames have a zero side ({width}x{height})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"video aspect ratio is above {MAX_ASPECT_RATIO} ({width}x{height})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    frames = round(num_frames / t) * t
    if frames * h * w > cfg.max_pixels:
        beta = math.sqrt(num_frames * height * width / cfg.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patch_timestamps(indices: Sequence[int], fps: float, per_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's times (the
    last frame repeated to fill the final patch)."""
    indices = list(indices)
    indices += [indices[-1]] * (-len(indices) % per_patch)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + per_patch - 1]) / 2 for i in range(0, len(times), per_patch)]


class Qwen3MediaProcessor(MediaProcessor):
    """Qwen2-VL's processor with Qwen3-VL's video sampling, sizing and prompt run."""

    def __init__(
        self,
        image_config: ProcessorConfig,
        video_config: ProcessorConfig,
        encode: Callable[[str], list[int]],
        markers: tuple[int, int, int],
        **limits: Any,
    ):
        super().__init__(image_config, video_config, **limits)
        self.encode = encode  # the tokenizer's, for the timestamps
        self.markers = markers  # <|vision_start|>, <|video_pad|>, <|vision_end|>

    @classmethod
    def from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_dir: str | Path,
        encode: Callable[[str], list[int]],
        markers: tuple[int, int, int],
        **limits: Any,
    ) -> Qwen3MediaProcessor:
        image, video = load_processor_configs(checkpoint_dir, IMAGE_DEFAULTS, VIDEO_DEFAULTS)
        return cls(image, video, encode, markers, **limits)

    def video_grid(self, frames, fps, kwargs=None) -> MediaGrid:
        grid = super().video_grid(frames, fps, kwargs)
        return replace(grid, run=self._run(grid, range(len(frames)), fps))

    def video_file_grid(self, data: bytes, kwargs: dict[str, Any] | None = None) -> MediaGrid:
        grid = super().video_file_grid(data, kwargs)
        meta = grid.video_metadata
        return replace(grid, run=self._run(grid, meta.frames_indices, meta.fps))

    def _sample_frames(self, total: int, source_fps: float, cfg: ProcessorConfig) -> list[int]:
        return sample_frame_indices(total, source_fps, cfg)

    def _resized(
        self, modality: VisionModality, num_frames: int, height: int, width: int, cfg
    ) -> tuple[int, int]:
        if modality != "video":
            return super()._resized(modality, num_frames, height, width, cfg)
        return video_resize(num_frames, height, width, cfg)

    def _run(self, grid: MediaGrid, indices: Sequence[int], fps: float) -> MediaRun:
        start, pad, end = self.markers
        t, h, w = grid.grid_thw
        m = self.video_config.merge_size
        per_frame = h * w // (m * m)
        counts = [per_frame] * t
        if grid.num_unpruned_tokens:
            # EVS: which frames keep how many is known once encoded; the run holds the kept
            # count spread evenly (the first frame whole) and the LM worker lays it out as
            # the frames kept it (models/qwen3_vl/family.py's DeepstackState.relayout).
            rest, others = grid.num_tokens - per_frame, max(t - 1, 1)
            counts = [per_frame] + [rest // others + (i < rest % others) for i in range(t - 1)]
        tokens: list[int] = []
        is_embed: list[bool] = []
        times = patch_timestamps(indices, fps, self.video_config.temporal_patch_size)
        assert len(times) == t, (len(times), grid.grid_thw)
        for seconds, count in zip(times, counts, strict=True):
            text = self.encode(f"<{seconds:.1f} seconds>")
            tokens += [*text, start, *[pad] * count, end]
            is_embed += [False] * (len(text) + 1) + [True] * count + [False]
        return MediaRun(tuple(tokens), tuple(is_embed), before=(start,), after=(end,))
