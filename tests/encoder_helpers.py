"""Helpers for the encoder worker tests: media bytes, Encode requests built as the proxy builds
them, a /metrics scraper and the reference embeddings of an item."""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from models.qwen2_vl.processing import MediaProcessor
from models.testing import ReferenceModel
from proto import epd_pb2
from tests.helpers import sign, write_config


def noise_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels: every patch differs, every seed gives other embeddings."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_item(mm_hash: str, data: bytes, **kwargs) -> epd_pb2.EncodeItem:
    """An item signed as the proxy signs it (the test cluster's secret)."""
    item = epd_pb2.EncodeItem(
        mm_hash=mm_hash, media=epd_pb2.MediaItem(image=data), mm_hash_tag=sign(mm_hash)
    )
    if kwargs:
        item.media.processor_kwargs.update(kwargs)
    return item


def video_item(mm_hash: str, frames: list[bytes], fps: float) -> epd_pb2.EncodeItem:
    video = epd_pb2.VideoFrames(frames=frames, fps=fps)
    return epd_pb2.EncodeItem(
        mm_hash=mm_hash, media=epd_pb2.MediaItem(video=video), mm_hash_tag=sign(mm_hash)
    )


def encoder_config(path: Path, checkpoint: Path, redis_url: str, **encoder) -> Path:
    return write_config(
        path,
        model={"path": str(checkpoint)},
        connector={"url": redis_url},
        encoder=encoder,
    )


class Scrape:
    """One read of a worker's /metrics: value(name, **labels) -> float (0 when absent)."""

    def __init__(self, port: int):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                self.samples[s.name, frozenset(s.labels.items())] = s.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    @property
    def epd(self) -> dict:
        """Only the epd_* samples (the encoder's and its connector's)."""
        return {k: v for k, v in self.samples.items() if k[0].startswith("epd_")}

    @property
    def batches(self) -> int:
        return int(self.value("epd_encoder_batch_items_count"))

    @property
    def encoded(self) -> int:
        return int(self.value("epd_encoder_items_encoded_total"))


def reference_embeddings(
    ref: ReferenceModel, items: list[epd_pb2.EncodeItem]
) -> list[torch.Tensor]:
    """The items preprocessed by the checkpoint's processor and run through the reference
    path's tower, all in one forward (as the worker batches them)."""
    processor: MediaProcessor = ref.processor
    processed = []
    for item in items:
        media = item.media
        kwargs = dict(media.processor_kwargs) or None
        if media.WhichOneof("payload") == "image":
            processed.append(processor.process_image(media.image, kwargs))
        else:
            processed.append(
                processor.process_video(list(media.video.frames), media.video.fps, kwargs)
            )
    return ref.embed_media(processed)
