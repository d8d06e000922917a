"""The encoder-only role ("E" of EPD): encodes media items and publishes them by mm_hash.

The work is in encoder.py (`MMEncoder.execute_mm_encoder` and the cross-request batch loop),
the model side in tower.py (the served family's processor and encoder), the gRPC edge in
server.py.
"""

from encoder_worker.server import main

__all__ = ["main"]
