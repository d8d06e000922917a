"""The encoder-only role ("E" of EPD): encodes media items and publishes them by mm_hash."""

from encoder_worker.server import main

__all__ = ["main"]
