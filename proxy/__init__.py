"""The proxy: gRPC Inference + OpenAI-compatible HTTP, cache-aware scheduling and routing."""

from proxy.server import main

__all__ = ["main"]
