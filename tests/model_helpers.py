"""Helpers the models test files share: tiny checkpoints, media bytes and the transformers
oracle loaded from the same directory our code loads."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from models.testing import ReferenceModel, make_checkpoint
from models.testing.reference import PreparedPrompt

TORCH_THREADS = 2


def build_tiny(root: Path, arch: str, **overrides) -> Path:
    """A tiny random checkpoint under root (named after its settings)."""
    name = "-".join([arch, *(f"{k}={v}" for k, v in sorted(overrides.items()))])
    return make_checkpoint(root / name, arch, "tiny", seed=0, **overrides)


def hf_model(checkpoint: Path):
    """transformers' model for a checkpoint, in eval mode, fp32."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    torch.set_num_threads(TORCH_THREADS)
    config = (checkpoint / "config.json").read_text()
    cls = (
        Qwen2_5_VLForConditionalGeneration
        if "Qwen2_5_VL" in config
        else Qwen2VLForConditionalGeneration
    )
    return cls.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_image_processor(**kwargs):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**kwargs)


def hf_inputs(model: ReferenceModel, prepared: PreparedPrompt) -> dict[str, torch.Tensor]:
    """The reference forward's inputs for a prompt our code prepared (same pixels)."""
    tokens = model.arch.tokens
    ids = torch.tensor([prepared.token_ids])
    mm_types = torch.zeros_like(ids)
    mm_types[ids == tokens.image_token_id] = 1
    mm_types[ids == tokens.video_token_id] = 2
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    images = [m for m in prepared.media if m.grid.modality == "image"]
    videos = [m for m in prepared.media if m.grid.modality == "video"]
    if images or videos:
        inputs["mm_token_type_ids"] = mm_types
    if images:
        inputs["pixel_values"] = torch.cat([m.pixel_values for m in images])
        inputs["image_grid_thw"] = torch.tensor([m.grid.grid_thw for m in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([m.pixel_values for m in videos])
        inputs["video_grid_thw"] = torch.tensor([m.grid.grid_thw for m in videos])
        if getattr(model.arch, "family", "") == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([m.grid.second_per_grid_t for m in videos])
    return inputs


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise with some structure (so resizing has something to do), in any Pillow mode."""
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, (height, width), dtype=np.uint16))
    base = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    base[..., 3] = rng.integers(0, 256, (height, width), dtype=np.uint8)
    rgba = Image.fromarray(base, "RGBA")
    if mode == "RGBA":
        return rgba
    if mode == "P+transparency":
        image = rgba.convert("RGB").convert("P")
        image.info["transparency"] = 0
        return image
    if mode in ("LA", "PA"):
        return rgba.convert(mode)
    return rgba.convert("RGB").convert(mode)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image.save(buf, fmt)
    return buf.getvalue()


def png(width: int, height: int, seed: int = 0) -> bytes:
    return encode(random_image(width, height, "RGB", seed))


CONTAINER_FORMATS = {"mp4": "mp4", "mov": "mov", "mkv": "matroska", "webm": "webm"}


def make_video(
    fmt: str = "mp4",
    num_frames: int = 8,
    fps: float = 4,
    width: int = 64,
    height: int = 48,
    seed: int = 0,
    still_every: int = 0,
) -> bytes:
    """A small video file encoded with PyAV: moving structured noise (so frames differ and
    resizing has something to do); with `still_every` = k, frames repeat in runs of k (EVS then
    finds tokens that equal the previous frame's)."""
    import av

    codec = "libvpx" if fmt == "webm" else "libx264"
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, 2 * width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=CONTAINER_FORMATS[fmt]) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            shift = (i // still_every if still_every else i) * 3 % width
            frame = np.ascontiguousarray(base[:, shift : shift + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def make_audio_only(seconds: float = 0.5) -> bytes:
    """An MP4 (M4A) holding one AAC audio stream and no video."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        samples = np.zeros((1, int(16000 * seconds)), dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
