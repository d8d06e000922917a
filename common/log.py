"""Logging for every epd process: one line per record, tagged with the process's name."""

from __future__ import annotations

import logging
import sys


def setup_logging(name: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)-7s [{name}] %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # gRPC's and aiohttp's own chatter stays at warnings.
    for noisy in ("aiohttp.access", "grpc._cython"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
