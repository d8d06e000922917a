"""The CPU's linear kernels, chosen by measurement at start-up, never by assumption.

Decode on a CPU is a chain of small matrix products that should run at memory speed, and which
kernel gets there depends on the machine: on one 2-core Sapphire Rapids host oneDNN's packed
`mkldnn_linear` ran 40 layers of 2048x768 at 1 row in 11 ms against torch's `F.linear` 20 ms; on
another of the same kind, 16.6 ms against 13.1 ms. So the LM worker times the candidates over
the model's own linear layers, in forward order so the weights stream from memory as in a real
step, at the row counts it will run (one decode row, and a full decode batch), checks that the
faster one gives the same numbers as `F.linear`, and keeps it. The choice is cached per CPU,
torch version, thread count and model shape, and logged.

Candidates: `linear` (torch's F.linear on the dense weights), `onednn` (mkldnn_linear on
weights packed once) and `mkl` (MKL's packed sgemm for one row, on weights packed once for it;
other row counts run F.linear on the dense weights it keeps). All run on torch's own thread
pool.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

Kernel = Literal["linear", "onednn", "mkl"]
KERNELS: tuple[Kernel, ...] = ("linear", "onednn", "mkl")


class PackedLinear(nn.Linear):
    """nn.Linear computed by oneDNN from a weight packed once (inference only). The dense
    weight is dropped unless another module shares it (a tied LM head shares the embedding's).

    The product runs `mkldnn::_linear_pointwise` (the op torch's inductor emits), which takes
    dense rows and gives a dense result, the same bits as `mkldnn_linear`; that one wants
    oneDNN tensors on both sides, and the conversions there and back cost about 75 us a layer
    under the profiler (`epd bench lm`, RESULTS.md)."""

    packed_weight: torch.Tensor
    _op = None  # torch.ops.mkldnn._linear_pointwise.default, set by use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return self._op(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


class MKLPackedLinear(nn.Linear):
    """nn.Linear whose one-row products (a decode step of one sequence) run MKL's packed sgemm
    on a copy of the weight packed for one row; other row counts run F.linear on the dense
    weight, which it keeps (inference only)."""

    packed_weight: torch.Tensor
    _op = None  # torch.ops.mkl._mkl_linear.default, set by use_kernel (no overload lookup)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the LM's [tokens, hidden]: no reshapes around the product
            if x.shape[0] != 1:
                return F.linear(x, self.weight, self.bias)
            return self._op(x.contiguous(), self.packed_weight, self.weight, self.bias, 1)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkl._mkl_linear(
            rows.contiguous(), self.packed_weight, self.weight, self.bias, 1
        )
        return out.view(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


_CLASSES = (nn.Linear, PackedLinear, MKLPackedLinear)


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's CPU fp32 linear layers, in module (forward) order."""
    return [
        m
        for m in model.modules()
        if type(m) in _CLASSES
        and m.weight is not None
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]


def use_kernel(model: nn.Module, kernel: Kernel, keep_dense: bool = False) -> int:
    """Switch the model's CPU fp32 linear layers to `kernel`; returns how many (0: the kernel
    is not built into this torch). With `keep_dense`, oneDNN-packed layers keep their dense
    weight (so the choice can be undone)."""
    if kernel == "onednn" and not onednn_available():
        return 0
    if kernel == "mkl" and not mkl_available():
        return 0
    layers = linear_layers(model)
    for module in layers:  # back to plain nn.Linear first
        if type(module) in (PackedLinear, MKLPackedLinear):
            del module.packed_weight
        module.__class__ = nn.Linear
    if kernel == "onednn":
        PackedLinear._op = torch.ops.mkldnn._linear_pointwise.default
        for module in layers:
            module.__class__ = PackedLinear
            module.packed_weight = module.weight.detach().to_mkldnn()
        if not keep_dense:
            _drop_unshared_dense_weights(model)
    elif kernel == "mkl":
        MKLPackedLinear._op = torch.ops.mkl._mkl_linear.default
        for module in layers:
            module.__class__ = MKLPackedLinear
            module.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(
                module.weight.detach(), 1
            )
    return len(layers)


def _drop_unshared_dense_weights(model: nn.Module) -> None:
    """A packed layer's dense weight is only needed if another module shares it."""
    uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    for module in model.modules():
        weight = module.weight if type(module) is PackedLinear else None
        if weight is not None and uses[id(weight)] == 1:
            module.weight = None


def _time_chain(layers: list[nn.Linear], rows: int, repeats: int = 3) -> float:
    """Best seconds of one pass over every layer at `rows` rows (weights stream from memory)."""
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - started)
    return best


def _same_numbers(layers: list[nn.Linear]) -> bool:
    """Packed and dense give the same outputs (to fp32 accumulation-order noise), at one row
    and at several."""
    with torch.inference_mode():
        for m in layers:
            for rows in (1, 3):
                x = torch.randn(rows, m.in_features)
                want = F.linear(x, m.weight, m.bias)
                if not torch.allclose(m(x), want, rtol=1e-4, atol=1e-5):
                    return False
    return True


def choose_linear_kernel(
    model: nn.Module, batch_rows: int, cache_dir: Path | None = None
) -> tuple[Kernel, dict[str, float]]:
    """Time the candidates at 1 row and `batch_rows` rows, switch the model to the fastest
    (summed over both) that holds the numbers, and return it with the timings (ms). A cached
    choice for this CPU, torch, thread count and model shape is reused without timing."""
    layers = linear_layers(model)
    if not layers:
        return "linear", {}
    key = _cache_key(layers, batch_rows)
    cache = cache_dir / "cpu_kernels.json" if cache_dir is not None else None
    known = _read_cache(cache)
    if key in known:
        kernel, timings = known[key]["kernel"], known[key]["ms"]
        use_kernel(model, kernel)
        return kernel, timings
    # Two rounds over the candidates, keeping each one's best: a burst of other work on the
    # machine then slows one round of every candidate, not one candidate.
    timings: dict[str, float] = {}
    usable = list(KERNELS)
    for _ in range(2):
        for kernel in list(usable):
            if use_kernel(model, kernel, keep_dense=True) == 0:
                usable.remove(kernel)  # not built into this torch
                continue
            if kernel != "linear" and not _same_numbers(layers):
                logger.warning(
                    "the %s linear kernel does not match F.linear here; not using it", kernel
                )
                usable.remove(kernel)
                continue
            for rows in sorted({1, batch_rows}):
                if kernel == "mkl" and rows != 1:
                    continue  # F.linear on the dense weights: the `linear` candidate's code
                name = f"{kernel}@{rows}"
                ms = round(_time_chain(layers, rows) * 1e3, 3)
                timings[name] = min(timings.get(name, ms), ms)
    if "mkl@1" in timings and batch_rows != 1:
        timings[f"mkl@{batch_rows}"] = timings[f"linear@{batch_rows}"]
    totals = {
        k: sum(v for name, v in timings.items() if name.startswith(k + "@"))
        for k in KERNELS
        if f"{k}@1" in timings
    }
    kernel = min(totals, key=totals.get)
    use_kernel(model, kernel)
    if cache is not None:
        known[key] = {"kernel": kernel, "ms": timings}
        _write_cache(cache, known)
    return kernel, timings


def _cache_key(layers: list[nn.Linear], batch_rows: int) -> str:
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for m in layers)
    machine = [
        platform.machine(),
        _cpu_model(),
        torch.__version__,
        torch.get_num_threads(),
        batch_rows,
        sorted(shapes.items()),
    ]
    return hashlib.sha256(json.dumps(machine, default=str).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    """The CPU's model name and feature flags (two machines that differ in either may choose
    differently)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return " | ".join(dict.fromkeys(ln for ln in lines if ln.startswith(wanted)))


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs a new measurement
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
    """Write the cache whole, through a temporary file of this writer's own: workers starting
    together on one host (prefill and decode, or several LM workers) each rename theirs into
    place, the last one wins, and a choice lost that way only costs a measurement later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every linear layer's (packed copies where
    packed), norms and biases; an embedding table is looked up, one row a token, so it does
    not count (a tied LM head reads its own packed copy)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        tensors = list(module._parameters.values())
        if isinstance(module, PackedLinear):
            tensors = [module.packed_weight, module.bias]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
