"""The LM's weights and KV cache on 2 MiB pages (Linux transparent huge pages), on the CPU.

A CPU decode step streams every weight once, and on 4 KiB pages that stream needs a new TLB
entry every 4 KiB: measured on a 2-core AMD EPYC (Zen 4), a sum over 400 MB read at 28.5-29 GB/s
on 4 KiB pages and 33-34.6 on 2 MiB ones. Safetensors checkpoints load as file mappings (the
page cache, 4 KiB pages) and torch's own allocations do not ask for huge pages, so the loader
copies the weights once into an anonymous private mapping that asks for them
(madvise(MADV_HUGEPAGE): what the kernel's default transparent huge page mode, "madvise",
grants), and the KV cache is allocated there too. Where the kernel gives none (mode "never",
no free 2 MiB frames, not Linux) the memory is ordinary memory and the loader's log says so.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor in an arena starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise or never), "" without THP."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return next((word[1:-1] for word in text.split() if word.startswith("[")), "")


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of CPU memory (uint8) holding zeros, starting on a 2 MiB boundary, that asks for
    2 MiB pages: a fresh anonymous private mapping, so its pages are the kernel's zeroed ones,
    given on first touch (nothing is committed before)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return torch.zeros(nbytes, dtype=torch.uint8)
    pages = -(-max(nbytes, 1) // HUGE_PAGE)  # whole huge pages, and one to align the start
    region = mmap.mmap(-1, (pages + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The mode "never" ignores it; a kernel built without THP refuses it (EINVAL): ordinary
    # pages either way, and the loader's log says so.
    with contextlib.suppress(OSError):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_bytes(*tensors: torch.Tensor) -> int:
    """About how many bytes of the contiguous `tensors` are on huge pages now (from
    /proc/self/smaps, read once: each mapping's huge pages, at most its overlap with each)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    ranges = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    total, overlaps = 0, []
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end ...
            start, end = (int(a, 16) for a in head.split("-"))
            overlaps = [max(0, min(end, hi) - max(start, lo)) for lo, hi in ranges]
        elif head == "AnonHugePages:" and any(overlaps):
            huge = int(line.split()[1]) * 1024
            total += sum(min(overlap, huge) for overlap in overlaps)
    return total


def move_parameters(model: nn.Module) -> torch.Tensor | None:
    """Every CPU parameter of `model` copied into one arena on huge pages (`empty`) and
    repointed there (tied weights stay tied: one parameter, one copy). The arena, or None when
    there is nothing to move. Call before anything keeps pointers into the weights (packed
    kernels, the fused decode)."""
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    if not params:
        return None
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.nbytes // _ALIGN) * _ALIGN
    arena = empty(size)
    with torch.no_grad():
        for p, at in zip(params, offsets, strict=True):
            moved = arena[at : at + p.nbytes].view(p.dtype).view(p.shape)
            moved.copy_(p)
            p.data = moved
    return arena
