"""The device a worker runs its model on, chosen once at start-up from `encoder.device` /
`lm.device`: auto (CUDA when there is one), cpu, or cuda (refused without one)."""

from __future__ import annotations

import torch


def resolve_device(choice: str, key: str) -> torch.device:
    """`key` names the setting in the error (e.g. "lm.device")."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{key} is cuda but torch finds no CUDA device: set {key}: auto")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)
