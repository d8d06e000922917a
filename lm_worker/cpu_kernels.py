"""The CPU's linear kernels, chosen by measurement at start-up, never by assumption.

Decode on a CPU is a chain of small matrix products that should run at memory speed, and which
kernel gets there depends on the machine: on one 2-core Sapphire Rapids host oneDNN's packed
`mkldnn_linear` ran 40 layers of 2048x768 at 1 row in 11 ms against torch's `F.linear` 20 ms; on
another of the same kind, 16.6 ms against 13.1 ms. So the LM worker times the candidates over
the model's own linear layers, in forward order so the weights stream from memory as in a real
step, at the row counts it will run (one decode row, and a full decode batch), checks that the
faster one gives the same numbers as `F.linear`, and keeps it. The choice is cached per CPU,
torch version, thread count and model shape, and logged.

The one-row kernel (a decode step of one sequence) and the batch kernel (a decode batch,
prefill) are chosen apart: a kernel that streams one row of products at memory speed is not
the one that runs 32 rows fastest. Candidates for one row: `linear` (torch's F.linear on the
dense weights), `onednn` (mkldnn_linear on weights packed once), `mkl` (MKL's packed sgemm for
one row, on weights packed once for it) and `gemv` (our own kernel, lm_worker/cpu_decode.c, built
here with the machine's C compiler on first use); for batches `linear` and `onednn`. A choice
is named "gemv+onednn" (one row + batch), or by one name where both are the same. All run on
torch's own thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from common.config import CPULinearKernel, cache_dir

logger = logging.getLogger(__name__)

Kernel = Literal["linear", "onednn", "mkl", "gemv"]
ROW_KERNELS: tuple[Kernel, ...] = ("linear", "onednn", "mkl", "gemv")  # for one-row products
BATCH_KERNELS: tuple[Kernel, ...] = ("linear", "onednn")  # for several rows
# A choice names the one-row kernel and the batch kernel, "gemv+onednn"; one name alone is
# that kernel for both where it runs batches, else F.linear for them ("gemv" = "gemv+linear").
KERNELS: tuple[str, ...] = get_args(CPULinearKernel)


def kernel_pair(name: str) -> tuple[Kernel, Kernel]:
    """(one-row kernel, batch kernel) of a choice's name."""
    row, _, batch = name.partition("+")
    batch = batch or (row if row in BATCH_KERNELS else "linear")
    if row not in ROW_KERNELS or batch not in BATCH_KERNELS:
        raise ValueError(f"unknown CPU linear kernel {name!r}: one of {', '.join(KERNELS)}")
    return row, batch


def kernel_name(row: Kernel, batch: Kernel) -> str:
    return row if kernel_pair(row) == (row, batch) else f"{row}+{batch}"


class CPULinear(nn.Linear):
    """nn.Linear on the kernels chosen for it (inference only): `row` for one-row products (a
    decode step of one sequence), `batch` for more rows. oneDNN reads a copy of the weight
    packed once (`packed_weight`), MKL's one-row sgemm a copy packed for one row
    (`mkl_weight`); F.linear and our gemv read the dense weight, which is dropped when no
    kernel of the layer reads it and no other module shares it (a tied LM head shares the
    embedding's).

    oneDNN runs `mkldnn::_linear_pointwise` (the op torch's inductor emits), which takes dense
    rows and gives a dense result, the same bits as `mkldnn_linear`; that one wants oneDNN
    tensors on both sides, and the conversions there and back cost about 75 us a layer under
    the profiler (`epd bench lm`, RESULTS.md)."""

    row: Kernel = "linear"
    batch: Kernel = "linear"
    packed_weight: torch.Tensor | None = None
    mkl_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the LM's [tokens, hidden] runs as it is (each call costs us)
            out = self.forward(x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], self.out_features)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        return _PRODUCTS[self.row if x.shape[0] == 1 else self.batch](self, x.contiguous())


_OPS: dict[str, Any] = {}  # op handles, looked up once by use_kernel (not per product)


def _linear(m: CPULinear, rows: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, m.weight, m.bias)


def _onednn(m: CPULinear, rows: torch.Tensor) -> torch.Tensor:
    return _OPS["onednn"](rows, m.packed_weight, m.bias, "none", [], "")


def _mkl(m: CPULinear, rows: torch.Tensor) -> torch.Tensor:
    return _OPS["mkl"](rows, m.mkl_weight, m.weight, m.bias, 1)


def _gemv(m: CPULinear, rows: torch.Tensor) -> torch.Tensor:
    return gemv(m.weight, rows, m.bias)


def gemv(weight: torch.Tensor, row: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """row [1, k] @ weight [n, k].T (+ bias) by our kernel, fp32 or bf16, all contiguous and of
    one dtype ([1, n]). c_library() must have loaded it."""
    n, k = weight.shape
    out = row.new_empty(1, n)
    bf16 = weight.dtype == torch.bfloat16
    failed = _OPS["gemv_bf16" if bf16 else "gemv"](
        weight.data_ptr(),
        row.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        k,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"gemv: no memory for a row of {k}")
    return out


_PRODUCTS = {"linear": _linear, "onednn": _onednn, "mkl": _mkl, "gemv": _gemv}

C_SOURCE = Path(__file__).with_name("cpu_decode.c")
CACHE_FILE = "cpu_kernels.json"  # measured choices, in the cache directory
C_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# cpu_decode.c's vectors (EPD_VEC floats): 512 and 256 bits. Which streams weights faster is
# the CPU's affair: on a 2-core Zen 4 (AVX-512) a chain of one-row products read 1.4x faster
# with 256-bit vectors, the same loop otherwise. Both are built; `c_library` keeps the faster.
VECTOR_BITS = (512, 256)
VECTOR_ENV = "EPD_CPU_VECTOR_BITS"  # an operator's fixed choice instead of the measurement


@functools.cache
def c_library() -> tuple[ctypes.CDLL | None, str]:
    """Our C kernels (cpu_decode.c: the one-row products, and lm_worker/cpu_decode.py's
    decoder layers), built once per machine and compiler into the cache directory, in each
    vector width, and loaded in the width measured faster here (`_faster_width`; or the one
    EPD_CPU_VECTOR_BITS names); or None and why not (no C compiler, a failed build, a torch
    not on OpenMP, or an OpenMP runtime other than torch's)."""
    if sys.platform != "linux":
        return None, "built on Linux only"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "torch does not run its threads on OpenMP here"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, "no C compiler (cc, or $CC)"
    fixed = os.environ.get(VECTOR_ENV, "")
    if fixed and fixed not in {str(b) for b in VECTOR_BITS}:
        raise ValueError(f"{VECTOR_ENV}: one of {', '.join(map(str, VECTOR_BITS))}, not {fixed!r}")
    widths = [int(fixed)] if fixed else list(VECTOR_BITS)
    try:
        libs = {bits: ctypes.CDLL(str(_built_library(compiler, bits))) for bits in widths}
    except (OSError, subprocess.SubprocessError) as e:  # a failed build, a noexec cache, ...
        logger.warning("our C kernels (gemv, fused decode) cannot run: %s", e)
        return None, str(e)
    runtimes = _openmp_runtimes()
    if len(runtimes) != 1:
        # Two runtimes' thread pools spin against each other on the same cores.
        return None, f"it would not share torch's OpenMP runtime (loaded: {sorted(runtimes)})"
    for lib in libs.values():
        for function in (lib.epd_gemv, lib.epd_gemv_bf16):
            function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int]
        lib.epd_gemv.restype = None
        lib.epd_gemv_bf16.restype = ctypes.c_int
        for function in (lib.epd_decode_layers, lib.epd_decode_step):
            function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
            function.restype = ctypes.c_int
        lib.epd_forward_tokens.argtypes = [ctypes.c_void_p] * 4 + [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.epd_forward_tokens.restype = ctypes.c_int
    if fixed:
        bits, how = int(fixed), f"set by {VECTOR_ENV}"
    else:
        bits, how = _faster_width(libs, compiler)
    logger.info("our C kernels run %d-bit vectors (%s)", bits, how)
    lib = libs[bits]
    _OPS["gemv"], _OPS["gemv_bf16"] = lib.epd_gemv, lib.epd_gemv_bf16
    return lib, ""


def _faster_width(libs: dict[int, ctypes.CDLL], compiler: str) -> tuple[int, str]:
    """The vector width whose one-row products stream a chain of weights faster (cached per
    machine, compiler, threads and source), and what was measured. The chain (96 MiB, three
    times a large L3) streams from memory as a decode step's weights do; the widths take turns,
    so that a moment of the host's noise falls on both."""
    threads = torch.get_num_threads()
    recipe = [_cpu_model(), compiler, threads, _source_digest()]
    key = "vector-" + hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]
    known = cached_choice(cache_dir(), key)
    if known is not None and known.get("bits") in libs:
        return known["bits"], f"cached: {known['ms']}"
    n, k, count = 2048, 1536, 8
    chain = [torch.empty(n, k).fill_(1.0 / k) for _ in range(count)]
    x, y = torch.ones(k), torch.empty(n)
    times: dict[int, list[float]] = {bits: [] for bits in libs}
    for _ in range(5):
        for bits, lib in libs.items():
            started = time.perf_counter()
            for w in chain:
                lib.epd_gemv(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads)
            times[bits].append(time.perf_counter() - started)
    medians = {bits: sorted(t)[len(t) // 2] for bits, t in times.items()}
    bits = min(medians, key=lambda b: medians[b])
    ms = ", ".join(f"{b}-bit {t * 1e3:.2f} ms" for b, t in medians.items())
    remember_choice(cache_dir(), key, {"bits": bits, "ms": ms})
    return bits, ms


@functools.cache
def _source_digest() -> str:
    """sha256 of our kernels' source ("" where it is missing: then they cannot be built)."""
    try:
        return hashlib.sha256(C_SOURCE.read_bytes()).hexdigest()
    except OSError:
        return ""


def _built_library(compiler: str, vector_bits: int) -> Path:
    """cpu_decode.c built for this CPU by `compiler` with vectors of `vector_bits` (once: kept
    in the cache directory)."""
    if not C_SOURCE.exists():
        raise OSError(f"our kernels' source is not installed: {C_SOURCE}")
    flags = [*C_FLAGS, f"-DEPD_VEC={vector_bits // 32}"]
    recipe = [_source_digest().encode(), " ".join(flags).encode(), compiler.encode()]
    recipe.append(_cpu_model().encode())  # -march=native builds for this CPU
    key = hashlib.sha256(b"\0".join(recipe)).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu-decode-{key}.so"

    def build(tmp: str) -> None:
        command = [compiler, *flags, str(C_SOURCE), "-o", tmp]
        built = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if built.returncode != 0:
            raise subprocess.SubprocessError(
                f"{' '.join(command)} failed: {built.stderr.strip()[-800:]}"
            )

    if not path.exists():
        _place(path, build)
    return path


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (Linux)."""
    names = ("libgomp", "libiomp", "libomp")
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(names):
            paths.add(os.path.realpath(path))
    return paths


def unavailable(name: str, dtype: torch.dtype = torch.float32) -> str:
    """Why the kernels `name` says cannot run here on `dtype` layers ("" when they can)."""
    reasons = (_unavailable(kernel, dtype) for kernel in dict.fromkeys(kernel_pair(name)))
    return "; ".join(why for why in reasons if why)


def _unavailable(kernel: Kernel, dtype: torch.dtype) -> str:
    if dtype != torch.float32 and kernel in ("onednn", "mkl"):
        return f"{kernel} is offered for float32 layers only, these are {dtype}"
    if kernel == "onednn" and not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return "oneDNN's linear op is not built into this torch"
    if kernel == "mkl" and not (
        torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    ):
        return "MKL's linear op is not built into this torch"
    if kernel == "gemv":
        return c_library()[1]
    return ""


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's CPU linear layers in float32 or bfloat16, in module (forward) order."""
    return [
        m
        for m in model.modules()
        if type(m) in (nn.Linear, CPULinear)
        and m.weight is not None
        and m.weight.device.type == "cpu"
        and m.weight.dtype in (torch.float32, torch.bfloat16)
        and m.weight.is_contiguous()  # our gemv reads rows in place
    ]


def why_not(model: nn.Module, name: str) -> str:
    """Why the kernels `name` says cannot run on this model's layers here ("" when they can)."""
    return unavailable(name, _dtype(linear_layers(model)))


def _dtype(layers: list[nn.Linear]) -> torch.dtype:
    """The layers' dtype: bfloat16 if any is (the kernels offered to all of them)."""
    bf16 = any(m.weight.dtype == torch.bfloat16 for m in layers)
    return torch.bfloat16 if bf16 else torch.float32


def use_kernel(model: nn.Module, name: str, keep_dense: bool = False) -> int:
    """Switch the model's CPU linear layers (float32, bfloat16) to the kernels `name` says (see
    kernel_pair); returns how many (0: a kernel of it cannot run here, `unavailable` says why).
    With `keep_dense`, every layer keeps its dense weight (so the choice can be undone)."""
    row, batch = kernel_pair(name)
    layers = linear_layers(model)
    if unavailable(name, _dtype(layers)):
        return 0
    if "onednn" in (row, batch):  # (gemv's functions: set by c_library, which loads them)
        _OPS["onednn"] = torch.ops.mkldnn._linear_pointwise.default
    if row == "mkl":
        _OPS["mkl"] = torch.ops.mkl._mkl_linear.default
    onednn = "onednn" in (row, batch)
    for module in layers:
        module.__class__ = CPULinear
        module.row, module.batch = row, batch
        weight = module.weight.detach()
        module.packed_weight = weight.to_mkldnn() if onednn else None
        module.mkl_weight = (
            torch.ops.mkl._mkl_reorder_linear_weight(weight, 1) if row == "mkl" else None
        )
    if (row, batch) == ("onednn", "onednn") and not keep_dense:
        _drop_unshared_dense_weights(model)
    return len(layers)


def _drop_unshared_dense_weights(model: nn.Module) -> None:
    """A layer that reads only its packed weight needs the dense one if another module
    shares it."""
    uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    for module in model.modules():
        weight = module.weight if type(module) is CPULinear else None
        if weight is not None and uses[id(weight)] == 1:
            module.weight = None


def _time_chain(layers: list[nn.Linear], rows: int, repeats: int = 3) -> float:
    """Best seconds of one pass over every layer at `rows` rows (weights stream from memory)."""
    dtype = _dtype(layers)
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in layers}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - started)
    return best


def _same_numbers(layers: list[nn.Linear]) -> bool:
    """The layers' kernels give F.linear's outputs (to accumulation-order noise: in bf16 a unit
    of the last place), at one row and at several."""
    with torch.inference_mode():
        for m in layers:
            bf16 = m.weight.dtype == torch.bfloat16
            rtol, atol = (1.6e-2, 1e-3) if bf16 else (1e-4, 1e-5)
            for rows in (1, 3):
                x = torch.randn(rows, m.in_features, dtype=m.weight.dtype)
                want = F.linear(x, m.weight, m.bias).float()
                if not torch.allclose(m(x).float(), want, rtol=rtol, atol=atol):
                    return False
    return True


def choose_linear_kernel(
    model: nn.Module, batch_rows: int, cache_dir: Path | None = None
) -> tuple[str, dict[str, float]]:
    """Time the candidates at 1 row and `batch_rows` rows, switch the model to the fastest that
    holds the numbers at each (one-row and batch kernels chosen apart, e.g. "gemv+onednn"),
    and return the choice's name with the timings (ms). A cached choice for this CPU, torch,
    thread count and model shape is reused without timing."""
    layers = linear_layers(model)
    if not layers:
        return "linear", {}
    key = choice_key(layers, batch_rows)
    known = cached_choice(cache_dir, key)
    if known is not None and use_kernel(model, known["kernel"]) > 0:  # else measured again
        return known["kernel"], known["ms"]
    # Two rounds over the candidates, keeping each one's best: a burst of other work on the
    # machine then slows one round of every candidate, not one candidate.
    timings: dict[str, float] = {}
    usable = list(ROW_KERNELS)
    for _ in range(2):
        for kernel in list(usable):
            if use_kernel(model, kernel, keep_dense=True) == 0:
                usable.remove(kernel)
                why = unavailable(kernel, _dtype(layers))
                logger.info("the %s linear kernel cannot run here: %s", kernel, why)
                continue
            if kernel != "linear" and not _same_numbers(layers):
                logger.warning(
                    "the %s linear kernel does not match F.linear here; not using it", kernel
                )
                usable.remove(kernel)
                continue
            for rows in sorted({1, batch_rows}):
                if rows == 1 or kernel in BATCH_KERNELS:
                    name = f"{kernel}@{rows}"
                    ms = round(_time_chain(layers, rows) * 1e3, 3)
                    timings[name] = min(timings.get(name, ms), ms)
    row = min(usable, key=lambda k: timings[f"{k}@1"])
    batch = kernel_pair(row)[1]
    if batch_rows != 1:
        batch = min(
            (k for k in usable if k in BATCH_KERNELS), key=lambda k: timings[f"{k}@{batch_rows}"]
        )
    kernel = kernel_name(row, batch)
    use_kernel(model, kernel)
    remember_choice(cache_dir, key, {"kernel": kernel, "ms": timings})
    return kernel, timings


def choice_key(layers: list[nn.Linear], batch_rows: int) -> str:
    """The key of a measured choice for these layers at up to `batch_rows` rows: the machine,
    torch, threads, the layers' shapes, the candidates and our kernels' source."""
    shapes = Counter(
        (m.in_features, m.out_features, m.bias is not None, str(m.weight.dtype)) for m in layers
    )
    machine = [
        platform.machine(),
        _cpu_model(),
        torch.__version__,
        torch.get_num_threads(),
        batch_rows,
        sorted(shapes.items()),
        KERNELS,  # a new candidate is measured, not passed over by an old choice
        _source_digest(),  # and a changed kernel is measured again
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


def cached_choice(cache_dir: Path | None, key: str) -> dict | None:
    """The choice cached under `key` in `cache_dir` (None: none, or no cache)."""
    if cache_dir is None:
        return None
    return _read_cache(cache_dir / CACHE_FILE).get(key)


def remember_choice(cache_dir: Path | None, key: str, choice: dict) -> None:
    """Cache a choice (the file read afresh first: other choices may have come meanwhile)."""
    if cache_dir is not None:
        known = _read_cache(cache_dir / CACHE_FILE)
        known[key] = choice
        _write_cache(cache_dir / CACHE_FILE, known)


def _read_cache(path: Path) -> dict:
    if not path.exists():
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
    _place(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True)))


def _place(path: Path, write: Callable[[str], None]) -> None:
    """Make `path` by `write(a temporary path)` in its directory, then rename that into place:
    writers at once (workers starting together on one host) each rename a file of their own,
    so none fails and none reads a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a decode step of one sequence reads: every linear layer's (oneDNN's
    packed copy where its one-row kernel is oneDNN; MKL's packed copy, padded to many times
    the weight on small layers, is counted as the weight it holds), norms and biases; an
    embedding table is looked up, one row a token, so it does not count (a tied LM head reads
    its own copy). A module with a `read_fraction` (MoE experts: top_k of num_experts) counts
    that fraction of its tensors: the share one token reads."""
    seen, total = set(), 0.0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        tensors = list(module._parameters.values())
        if isinstance(module, CPULinear) and module.row == "onednn":
            tensors = [module.packed_weight, module.bias]
        fraction = getattr(module, "read_fraction", 1.0)
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size() * fraction
    return int(total)
