"""Video containers and EVS in the models layer.

- frame sampling equals an independent implementation of transformers' Qwen2-VL video
  processor rule; the pixels equal transformers' image processor (Qwen2VLImageProcessorPil) run
  on every sampled frame (its video processor needs torchvision, which is not installed here),
  frames decoded independently with PyAV; the header-only grid equals the full preprocessing's;
- the EVS retention mask equals an independent, loop-by-loop implementation of the rule; the
  position channels survive every embedding dtype;
- bad containers raise MediaError naming the problem.
"""

from __future__ import annotations

import io
import math
import warnings

import av
import numpy as np
import pytest
import torch
from PIL import Image

from models import MediaError, MediaInput
from models.qwen2_vl import evs
from models.qwen2_vl.config import ProcessorConfig
from models.qwen2_vl.processing import MediaProcessor, sample_frame_indices
from tests.model_helpers import hf_image_processor, make_audio_only, make_video

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64


def reference_indices(total: int, source_fps: float, fps, min_frames, max_frames, t) -> list[int]:
    """transformers' documented rule: fps frames per second of video, within [min_frames,
    max_frames] and the stream, a multiple of t, spread evenly from frame 0."""
    cap = (min(max_frames, total) // t) * t
    n = min(max(total / source_fps * fps, min_frames), cap, total)
    n = math.floor(n / t) * t
    step = np.float32(total / n)
    # torch.arange(0, total, step) in float32, each value truncated toward zero.
    return [int(np.float32(i) * step) for i in range(n)]


@pytest.mark.parametrize("total", [2, 3, 7, 10, 31, 100, 241, 1000])
@pytest.mark.parametrize(("source_fps", "fps"), [(30.0, 2.0), (25.0, 1.0), (4.0, 2.0), (1.0, 3.0)])
@pytest.mark.parametrize(("min_frames", "max_frames"), [(4, 768), (2, 16)])
def test_frame_sampling_equals_reference_rule(total, source_fps, fps, min_frames, max_frames):
    cfg = ProcessorConfig(fps=fps, min_frames=min_frames, max_frames=max_frames)
    want = reference_indices(total, source_fps, fps, min_frames, max_frames, 2)
    got = sample_frame_indices(total, source_fps, cfg)
    assert got == want
    assert len(got) % 2 == 0 and got == sorted(set(got)) and got[-1] < total


def decode_all(data: bytes) -> list[np.ndarray]:
    """Every frame, decoded independently of the code under test."""
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def hf_frame(frame: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_image_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(
            images=[Image.fromarray(frame)], return_tensors="np"
        )
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    return out["pixel_values"], grid


@pytest.fixture(scope="module")
def processor() -> MediaProcessor:
    cfg = ProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return MediaProcessor(cfg, cfg)


@pytest.mark.parametrize(
    ("fmt", "num_frames", "fps", "size"),
    [
        ("mp4", 9, 4, (64, 48)),
        ("webm", 12, 6, (70, 50)),
        ("mkv", 7, 2, (90, 40)),
        ("mov", 16, 8, (48, 64)),
    ],
)
def test_container_pixels_equal_image_processor_per_frame(processor, fmt, num_frames, fps, size):
    data = make_video(fmt, num_frames, fps, *size, seed=num_frames)
    got = processor.preprocess(MediaInput("video", video=data))
    frames = decode_all(data)
    assert len(frames) == num_frames
    cfg = processor.video_config
    indices = reference_indices(num_frames, fps, cfg.fps, cfg.min_frames, cfg.max_frames, 2)
    meta = got.grid.video_metadata
    assert meta.frames_indices == tuple(indices)
    assert meta.total_num_frames == num_frames and meta.fps == fps
    assert meta.timestamps == tuple(i / fps for i in indices)
    sampled_fps = len(indices) / num_frames * fps
    assert got.grid.second_per_grid_t == pytest.approx(2 / sampled_fps)
    # A video patch is the patches of its two frames stacked on the temporal axis; the image
    # processor's patch holds its frame twice (take copy 0).
    per_frame = [hf_frame(frames[i]) for i in indices]
    _, gh, gw = per_frame[0][1]
    stills = [p.reshape(gh * gw, 3, 2, 14, 14)[:, :, 0] for p, _ in per_frame]
    groups = [np.stack(stills[i : i + 2], axis=2) for i in range(0, len(stills), 2)]
    want = np.concatenate(groups).reshape(-1, 3 * 2 * 14 * 14)
    assert got.grid.grid_thw == (len(groups), gh, gw)
    np.testing.assert_array_equal(got.pixel_values.numpy(), want)
    # The header alone gives the same grid and count (the proxy decodes nothing).
    assert processor.grid(MediaInput("video", video=data)) == got.grid
    assert got.grid.num_tokens == len(groups) * gh * gw // 4


def test_sampling_kwargs_per_item(processor):
    data = make_video("mp4", 24, 8, seed=3)
    default = processor.grid(MediaInput("video", video=data))
    assert len(default.video_metadata.frames_indices) == 6  # 3 s at 2 fps
    dense = processor.grid(MediaInput("video", video=data, kwargs={"fps": 4}))
    assert dense.video_metadata.frames_indices == tuple(range(0, 24, 2))
    capped = processor.grid(MediaInput("video", video=data, kwargs={"fps": 8, "max_frames": 4}))
    assert capped.video_metadata.frames_indices == (0, 6, 12, 18)
    with pytest.raises(MediaError, match="unknown video processor kwargs"):
        processor.grid(MediaInput("video", video=data, kwargs={"frames": 3}))


# -- EVS ------------------------------------------------------------------------------------------


def reference_mask(embeds: np.ndarray, grid, merge: int, q: float) -> np.ndarray:
    """The rule, token by token: dissimilarity 1 - cos with the same position one frame back,
    the first frame always kept, the max(per frame, int(total * (1 - q))) most dissimilar kept,
    earlier first among equals."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    per_frame = h * w
    x = embeds.astype(np.float32).reshape(t, per_frame, -1)
    score = []
    for f in range(t):
        for s in range(per_frame):
            if f == 0:
                score.append(math.inf)
                continue
            a, b = x[f, s], x[f - 1, s]
            cos = float(np.dot(a, b)) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8)
            score.append(1 - cos)
    keep = max(per_frame, int(t * per_frame * (1 - q)))
    ranked = sorted(range(len(score)), key=lambda i: (-score[i], i))[:keep]
    mask = np.zeros(len(score), dtype=bool)
    mask[ranked] = True
    return mask


@pytest.mark.parametrize("q", [0.5, 0.75, 0.9])
@pytest.mark.parametrize("grid", [(4, 4, 6), (3, 8, 4), (1, 4, 4), (6, 2, 2)])
def test_retention_mask_equals_reference(q, grid):
    merge = 2
    n = grid[0] * grid[1] * grid[2] // 4
    g = torch.Generator().manual_seed(n)
    embeds = torch.randn(n, 16, generator=g)
    # Repeated frames and repeated tokens: exact ties the order must break the same way.
    per_frame = n // grid[0]
    if grid[0] > 2:
        embeds[per_frame : 2 * per_frame] = embeds[:per_frame]
        embeds[2 * per_frame] = embeds[per_frame]
    got = evs.retention_mask(embeds, grid, merge, q).numpy()
    want = reference_mask(embeds.numpy(), grid, merge, q)
    np.testing.assert_array_equal(got, want)
    assert got.sum() == evs.retained_count(grid, merge, q)
    assert got[:per_frame].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_position_channels_are_exact_in_every_dtype(dtype):
    grid, merge = (40, 8, 6), 2
    positions = evs.video_positions(grid, merge, 2.0, 25.0)  # t reaches 39 * 50 = 1950
    assert int(positions[:, 0].max()) == 1950
    embeds = torch.randn(len(positions), 32).to(dtype)
    wide = evs.append_positions(embeds, positions)
    assert wide.shape == (len(positions), 32 + evs.POSITION_CHANNELS) and wide.dtype == dtype
    stripped, back = evs.split_positions(wide, 32)
    assert torch.equal(stripped, embeds) and torch.equal(back, positions)
    # (t, h, w, grid width), frame-major, t scaled as the unpruned M-RoPE path scales it.
    assert positions[:4].tolist() == [[0, 0, 0, 3], [0, 0, 1, 3], [0, 0, 2, 3], [0, 1, 0, 3]]
    assert positions[12].tolist() == [50, 0, 0, 3]


def test_pruned_count_from_the_header():
    cfg = ProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    data = make_video("mp4", 16, 4, 64, 48, seed=5)
    plain = MediaProcessor(cfg, cfg).grid(MediaInput("video", video=data))
    for q in (0.5, 0.75):
        pruned = MediaProcessor(cfg, cfg, video_pruning_rate=q).grid(
            MediaInput("video", video=data)
        )
        assert pruned.grid_thw == plain.grid_thw
        assert pruned.num_unpruned_tokens == plain.num_tokens == pruned.encoder_tokens
        assert pruned.num_tokens == evs.retained_count(plain.grid_thw, 2, q) < plain.num_tokens


# -- bad containers -------------------------------------------------------------------------------


def bad_cases() -> dict[str, tuple[bytes, str]]:
    mp4 = make_video("mp4", 12, 4, seed=9)
    mkv = make_video("mkv", 40, 4, seed=9)
    return {
        "garbage": (b"\x00\x01not a video at all" * 20, "not a readable video container"),
        "empty": (b"", "video has no frames"),
        "truncated mp4": (mp4[: len(mp4) // 2], "not a readable video container"),
        "truncated mkv": (mkv[: len(mkv) // 3], "truncated"),
        "audio only": (make_audio_only(), "no video stream"),
        "one frame": (make_video("mp4", 1, 4, seed=9), "sampling needs at least 2"),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_containers_name_the_problem(processor, case):
    data, reason = bad_cases()[case]
    with pytest.raises(MediaError, match=reason):
        processor.preprocess(MediaInput("video", video=data))


def test_video_limits(processor):
    cfg = processor.video_config
    data = make_video("mp4", 40, 4, seed=2)  # 10 s -> 20 sampled frames
    with pytest.raises(MediaError, match=r"10\.0 s long, above the limit of 5 s"):
        MediaProcessor(cfg, cfg, max_video_seconds=5).grid(MediaInput("video", video=data))
    with pytest.raises(MediaError, match="samples to 20 frames, more than 8"):
        MediaProcessor(cfg, cfg, max_frames=8).grid(MediaInput("video", video=data))


def test_mm_hash_covers_container_bytes_and_sampling_settings():
    from proxy.prepare import mm_hash

    data = make_video("mp4", 8, 4, seed=6)
    base = mm_hash("fp", MediaInput("video", video=data))
    assert base == mm_hash("fp", MediaInput("video", video=bytes(data)))
    others = [
        mm_hash("fp", MediaInput("video", video=data, kwargs={"fps": 1})),
        mm_hash("fp", MediaInput("video", video=data, kwargs={"max_frames": 4})),
        mm_hash("fp", MediaInput("video", video=data[:-1] + b"\x00")),
        mm_hash("fp2", MediaInput("video", video=data)),
        mm_hash("fp", MediaInput("video", frames=(data,), fps=4.0)),
    ]
    assert len({base, *others}) == 1 + len(others)


def test_pruning_rate_is_in_the_fingerprint(tiny_checkpoint):
    from models import FamilyOptions, load_family

    prints = {
        q: load_family(tiny_checkpoint, FamilyOptions(video_pruning_rate=q)).fingerprint(
            torch.float32
        )
        for q in (None, 0.0, 0.5, 0.75)
    }
    assert prints[None] == prints[0.0]  # the checkpoint's own rate is 0
    assert len({prints[0.0], prints[0.5], prints[0.75]}) == 3
