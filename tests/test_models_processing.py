"""Preprocessing against transformers' Qwen2VLImageProcessorPil: pixel values and grids equal
(exactly, 0.0 difference), header-only grids equal the full preprocessing's, bad media raises
MediaError with its reason."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from models import MediaError
from models.qwen2_vl.config import ProcessorConfig
from models.qwen2_vl.processing import MediaProcessor, smart_resize
from tests.model_helpers import build_tiny, encode, hf_image_processor, png, random_image

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256

CASES = [
    # (width, height, mode, format)
    (1, 1, "RGB", "PNG"),  # tiny: scaled up to min_pixels
    (3, 7, "L", "PNG"),
    (28, 28, "RGB", "JPEG"),
    (29, 57, "RGBA", "PNG"),  # odd sides, alpha composited onto white
    (57, 29, "LA", "PNG"),
    (123, 77, "P", "GIF"),
    (90, 60, "P+transparency", "PNG"),
    (101, 99, "CMYK", "JPEG"),
    (64, 48, "I;16", "PNG"),
    (80, 40, "1", "BMP"),
    (2000, 10, "RGB", "PNG"),  # aspect ratio 200, the most the reference accepts
    (10, 1500, "RGB", "WEBP"),
    (1200, 900, "RGB", "JPEG"),  # above max_pixels: scaled down
    (517, 311, "RGB", "TIFF"),
]


def reference(data: bytes, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_image_processor(**kwargs)(
            images=[Image.open(io.BytesIO(data))], return_tensors="np"
        )
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


@pytest.fixture(scope="module")
def processor() -> MediaProcessor:
    cfg = ProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return MediaProcessor(cfg, cfg)


@pytest.mark.parametrize(("width", "height", "mode", "fmt"), CASES, ids=lambda v: str(v))
def test_image_equals_reference(processor, width, height, mode, fmt):
    data = encode(random_image(width, height, mode, seed=width * 7 + height), fmt)
    want_pixels, want_grid = reference(data, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    got = processor.process_image(data)
    assert got.grid.grid_thw == want_grid
    assert got.pixel_values.shape == want_pixels.shape
    np.testing.assert_array_equal(got.pixel_values.numpy(), want_pixels)
    # The header alone gives the same grid and placeholder count.
    header = processor.image_grid(data)
    assert header == got.grid
    assert header.num_tokens == np.prod(want_grid) // 4 == want_pixels.shape[0] // 4


def test_a_picture_in_memory_equals_its_lossless_encoding(processor):
    # Training hands its drawn pictures over without the PNG round trip.
    for width, height, mode in ((517, 311, "RGB"), (29, 57, "RGBA"), (3, 7, "L")):
        image = random_image(width, height, mode, seed=width)
        got = processor.process_picture(image)
        want = processor.process_image(encode(image, "PNG"))
        assert got.grid == want.grid
        assert np.array_equal(got.pixel_values.numpy(), want.pixel_values.numpy())


def test_default_limits_and_checkpoint_config(tmp_path):
    # The real default budget (28*28*1280) on a photo-sized image, and the settings read from a
    # checkpoint's preprocessor_config.json against the reference reading the same file.
    data = encode(random_image(1500, 1000, seed=3), "JPEG")
    want_pixels, want_grid = reference(data)
    got = MediaProcessor(ProcessorConfig(), ProcessorConfig()).process_image(data)
    assert got.grid.grid_thw == want_grid
    np.testing.assert_array_equal(got.pixel_values.numpy(), want_pixels)

    ckpt = build_tiny(tmp_path, "qwen2_5_vl")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    ref = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
    ours = MediaProcessor.from_checkpoint(ckpt)
    out = ref(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    got = ours.process_image(data)
    assert got.grid.grid_thw == tuple(out["image_grid_thw"][0])
    np.testing.assert_array_equal(got.pixel_values.numpy(), out["pixel_values"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_pixels": 28 * 28 * 4},
        {"min_pixels": 28 * 28 * 100},
        {"size": {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 20}},
    ],
)
def test_per_item_kwargs(processor, kwargs):
    data = png(300, 200, seed=1)
    size = dict(kwargs.get("size", {}))
    size.setdefault("shortest_edge", kwargs.get("min_pixels", MIN_PIXELS))
    size.setdefault("longest_edge", kwargs.get("max_pixels", MAX_PIXELS))
    want_pixels, want_grid = reference(data, size=size)
    got = processor.process_image(data, kwargs)
    assert got.grid.grid_thw == want_grid
    np.testing.assert_array_equal(got.pixel_values.numpy(), want_pixels)
    assert processor.image_grid(data, kwargs) == got.grid
    # Counted the way the reference's own helper counts (vLLM uses it).
    patches = hf_image_processor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    want = patches.get_number_of_image_patches(
        200, 300, {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
    )
    assert got.grid.num_tokens == want // 4


@pytest.mark.parametrize(("num_frames", "fps"), [(4, 2.0), (3, 1.0), (1, 24.0)])
def test_video_equals_image_processor_on_frames(processor, num_frames, fps):
    # transformers' video processor needs torchvision (not installable here), so the oracle is
    # the image processor run on every frame: a video patch is the frames' patches stacked on
    # the temporal axis (an odd count repeats the last frame).
    frames = [png(70, 50, seed=i) for i in range(num_frames)]
    got = processor.process_video(frames, fps)
    per_frame = [reference(f, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)[0] for f in frames]
    per_frame += [per_frame[-1]] * (len(per_frame) % 2)
    _, gh, gw = reference(frames[0], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)[1]
    # Each row is [C, T, P, P] with T identical copies of the frame; take copy 0 of each frame.
    stills = [p.reshape(gh * gw, 3, 2, 14, 14)[:, :, 0] for p in per_frame]
    groups = [np.stack(stills[i : i + 2], axis=2) for i in range(0, len(stills), 2)]
    want = np.concatenate(groups).reshape(-1, 3 * 2 * 14 * 14)
    assert got.grid.grid_thw == (len(groups), gh, gw)
    assert got.grid.second_per_grid_t == pytest.approx(2 / fps)
    np.testing.assert_array_equal(got.pixel_values.numpy(), want)
    assert processor.video_grid(frames, fps) == got.grid


def test_smart_resize_keeps_budget():
    for h, w in [(1, 1), (15, 3000), (4000, 3000), (28, 56), (100, 100)]:
        rh, rw = smart_resize(h, w, 28, MIN_PIXELS, MAX_PIXELS)
        assert rh % 28 == 0 and rw % 28 == 0
        assert MIN_PIXELS <= rh * rw <= MAX_PIXELS


# -- bad media ------------------------------------------------------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares a size but holds (almost) no pixel data."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))


BAD_MEDIA = [
    (b"", "empty"),
    (b"this is not an image at all", "not a recognised image format"),
    (png(64, 64)[:200], "corrupt or truncated"),
    (encode(random_image(64, 64), "JPEG")[:1500], "corrupt or truncated"),
    (png_header(100_000, 100_000), "decompression bomb"),
    (png_header(0, 10), ""),
    (png(4000, 10), "aspect ratio"),
]


@pytest.mark.parametrize(("data", "reason"), BAD_MEDIA, ids=range(len(BAD_MEDIA)))
def test_bad_media_raises_media_error(processor, data, reason):
    with pytest.raises(MediaError) as info:
        processor.process_image(data)
    assert reason in info.value.reason
    assert str(info.value) == info.value.reason
    if "truncated" not in reason:  # a truncated body still has a good header
        with pytest.raises(MediaError):
            processor.image_grid(data)


def test_pixel_limit_is_ours_and_checked_on_the_header():
    # A small file that decodes to many pixels: refused from the header, before decoding.
    data = encode(Image.new("L", (2000, 1000)), "PNG")
    assert len(data) < 10_000
    cfg = ProcessorConfig()
    strict = MediaProcessor(cfg, cfg, max_image_pixels=1_000_000)
    with pytest.raises(MediaError, match="above the limit of 1000000"):
        strict.image_grid(data)
    with pytest.raises(MediaError, match="decompression bomb"):
        strict.process_image(data)
    assert MediaProcessor(cfg, cfg).image_grid(data).grid_thw[0] == 1


def test_bad_video_and_kwargs(processor):
    with pytest.raises(MediaError, match="no frames"):
        processor.process_video([], 2.0)
    with pytest.raises(MediaError, match="fps"):
        processor.video_grid([png(32, 32)], 0)
    with pytest.raises(MediaError, match="differ in size"):
        processor.video_grid([png(32, 32), png(40, 32)], 2.0)
    with pytest.raises(MediaError, match="unknown image processor kwargs"):
        processor.image_grid(png(32, 32), {"resample": 0})
    with pytest.raises(MediaError, match="min_pixels <= max_pixels"):
        processor.image_grid(png(32, 32), {"min_pixels": 10_000, "max_pixels": 5_000})
