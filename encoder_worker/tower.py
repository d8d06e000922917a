"""The encoder's model side: the served family's media processor and encoder, on one device,
chosen once at start-up.

Only the encoder's tensors are read (`family.load_encoder`): no LM weights, no KV cache. It
runs in the model's serving dtype (`resolve_model`), not the device's preference, because the
embedding cache's keys carry that dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from common.config import ClusterConfig
from common.device import resolve_device
from common.served_model import ServedModel, resolve_model
from models import MediaGrid, MediaInput, ProcessedMedia
from models.family import MediaEncoder, MediaProcessor

logger = logging.getLogger(__name__)


class Tower:
    """prepare (any thread, CPU) -> run (one batch at a time, on the device)."""

    def __init__(self, processor: MediaProcessor, encoder: MediaEncoder):
        self.processor = processor
        self.encoder = encoder
        self.device = encoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.dtype

    @property
    def width(self) -> int:
        """Channels per embedding."""
        return self.encoder.width

    def grid(self, item: MediaInput) -> MediaGrid:
        """Header only; MediaError for what the processor cannot take."""
        return self.processor.grid(item)

    def prepare(self, item: MediaInput) -> ProcessedMedia:
        """Decode and preprocess one item (thread-safe; MediaError for a bad item)."""
        return self.processor.preprocess(item)

    @torch.inference_mode()
    def run(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """One forward over the whole batch -> one [num_tokens, width] CPU tensor per item, in
        the encoder's dtype."""
        outputs = self.encoder.embed(batch)
        if self.device.type == "cuda":
            # NOTE: one device-to-host copy for the batch, not one per item.
            flat = torch.cat(outputs).cpu()
            return list(flat.split([o.shape[0] for o in outputs]))
        return outputs

    def warm_up(self) -> None:
        """One encode of the family's warm-up item: the whole path (decode, preprocess,
        forward) runs once before the worker says SERVING."""
        (out,) = self.run([self.prepare(self.processor.warmup_item())])
        assert out.shape[-1] == self.width and out.dtype == self.dtype, (out.shape, out.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "encoder warm on %s (%s, %d-wide embeddings)", self.device, self.dtype, self.width
        )


def load_tower(config: ClusterConfig) -> tuple[Tower, ServedModel]:
    """The served model's processor and encoder on `encoder.device`, warm (blocking: run it in
    a thread)."""
    served = resolve_model(config)
    device = resolve_device(config.encoder.device, "encoder.device")
    share = config.encoder.gpu_memory_utilization
    if device.type == "cuda":  # what LM workers beside it leave out of their share
        torch.cuda.set_per_process_memory_fraction(share, device)
    processor = served.family.processor(config.encoder.max_image_pixels)
    try:
        tower = Tower(processor, served.family.load_encoder(served.dtype, device))
        tower.warm_up()
    except torch.OutOfMemoryError as e:
        total = torch.cuda.get_device_properties(device).total_memory
        raise RuntimeError(
            f"the encoder does not fit its share of {device}: encoder.gpu_memory_utilization "
            f"{share} is {share * total / 2**30:.2f} GiB ({e})"
        ) from e
    if device.type == "cuda":
        logger.info(
            "encoder on %s: %.2f GiB held after warm-up, of its share %.2f GiB "
            "(encoder.gpu_memory_utilization %s)",
            device,
            torch.cuda.memory_allocated(device) / 2**30,
            share * torch.cuda.get_device_properties(device).total_memory / 2**30,
            share,
        )
    return tower, served
