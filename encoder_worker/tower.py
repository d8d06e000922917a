"""The encoder's model side: the checkpoint's media processor and its vision tower, on one
device, chosen once at start-up.

Only the tower's tensors are read (`VisionTower.from_checkpoint` loads role "vision"): no LM
weights, no KV cache. The tower runs in the model's serving dtype (`resolve_model`), not the
device's preference, because the embedding cache's keys carry that dtype.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from epd.config import ClusterConfig
from epd.media import MediaInput, media_grid, preprocess_media
from epd.served_model import ServedModel, resolve_model
from models import MediaGrid, MediaProcessor, ProcessedMedia, VisionTower

logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """`encoder.device`: auto (CUDA when there is one), cpu, or cuda (refused without one)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("encoder.device is cuda, but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


class Tower:
    """prepare (any thread, CPU) -> run (one batch at a time, on the device)."""

    def __init__(self, processor: MediaProcessor, tower: VisionTower, device: torch.device):
        self.processor = processor
        self.tower = tower
        self.device = device

    @classmethod
    def load(
        cls,
        checkpoint_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        max_image_pixels: int | None = None,
    ) -> Tower:
        limits = {"max_image_pixels": max_image_pixels} if max_image_pixels else {}
        processor = MediaProcessor.from_checkpoint(checkpoint_dir, **limits)
        tower = VisionTower.from_checkpoint(checkpoint_dir, dtype, device)
        return cls(processor, tower, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.dtype

    @property
    def width(self) -> int:
        """Channels per embedding."""
        return self.tower.config.out_hidden_size

    def grid(self, item: MediaInput) -> MediaGrid:
        """Header only; MediaError for what the processor cannot take."""
        return media_grid(self.processor, item)

    def prepare(self, item: MediaInput) -> ProcessedMedia:
        """Decode and preprocess one item (thread-safe; MediaError for a bad item)."""
        return preprocess_media(self.processor, item)

    def run(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """One forward over the whole batch -> one [num_tokens, width] CPU tensor per item, in
        the tower's dtype."""
        pixels = torch.cat([m.pixel_values for m in batch])  # [sum of t*h*w, C * T * P * P]
        if self.device.type == "cuda":
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        outputs = self.tower.embed_multimodal(pixels, [m.grid.grid_thw for m in batch])
        if self.device.type == "cuda":
            # NOTE: one device-to-host copy for the batch, not one per item.
            flat = torch.cat(outputs).cpu()
            return list(flat.split([o.shape[0] for o in outputs]))
        return outputs

    def warm_up(self) -> None:
        """One encode of a small synthetic image: the whole path (decode, preprocess, forward)
        runs once before the worker says SERVING."""
        side = 2 * self.processor.image_config.factor
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (127, 127, 127)).save(buf, "PNG")
        (out,) = self.run([self.prepare(MediaInput("image", image=buf.getvalue()))])
        assert out.shape[-1] == self.width and out.dtype == self.dtype, (out.shape, out.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "vision tower warm on %s (%s, %d-wide embeddings)", self.device, self.dtype, self.width
        )


def load_tower(config: ClusterConfig) -> tuple[Tower, ServedModel]:
    """The served model's tower on `encoder.device`, warm (blocking: run it in a thread)."""
    served = resolve_model(config)
    device = resolve_device(config.encoder.device)
    tower = Tower.load(served.path, served.dtype, device, config.encoder.max_image_pixels)
    tower.warm_up()
    return tower, served
