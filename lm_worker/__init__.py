"""The LM role ("PD" of EPD): continuous-batched prefill and decode over gathered embeddings."""

from lm_worker.server import main

__all__ = ["main"]
