"""The CPU linear kernels chosen by measurement: whichever win, the numbers stay F.linear's, and
the choice is cached per machine and model shape. Our own one-row kernel (lm_worker/cpu_decode.c) is
built with the machine's C compiler, held against F.linear here, and refused with a reason
where it cannot be built."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from common.config import LMConfig
from lm_worker import cpu_kernels
from lm_worker.cpu_kernels import (
    KERNELS,
    choose_linear_kernel,
    kernel_pair,
    unavailable,
    use_kernel,
    weight_bytes,
)
from tests.lm_helpers import make_engine

needs_gemv = pytest.mark.skipif(
    bool(unavailable("gemv")), reason=f"our gemv kernel cannot run here: {unavailable('gemv')}"
)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32, bias=False), nn.Linear(32, 64))


def test_choice_keeps_the_numbers_and_is_cached(tmp_path):
    model = mlp()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = model(x)
    kernel, timings = choose_linear_kernel(model, batch_rows=8, cache_dir=tmp_path)
    assert kernel in KERNELS
    assert {"linear@1", "linear@8"} <= set(timings)
    # The one-row and the batch kernel are each the fastest measured for their rows.
    row, batch = kernel_pair(kernel)
    assert timings[f"{row}@1"] == min(v for k, v in timings.items() if k.endswith("@1"))
    assert timings[f"{batch}@8"] == min(v for k, v in timings.items() if k.endswith("@8"))
    assert {(m.row, m.batch) for m in model} == {(row, batch)}
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)

    cached = json.loads((tmp_path / "cpu_kernels.json").read_text())
    assert [entry["kernel"] for entry in cached.values()] == [kernel]
    # Another model of the same shape on the same machine reuses the measurement.
    again, again_timings = choose_linear_kernel(mlp(seed=1), batch_rows=8, cache_dir=tmp_path)
    assert (again, again_timings) == (kernel, timings)


def test_switching_kernels_back_and_forth_keeps_outputs():
    model = mlp()
    x = torch.randn(3, 64)
    one = torch.randn(1, 64)
    with torch.inference_mode():
        want, want_one = model(x), model(one)
        dense = weight_bytes(model)
        for kernel in (*KERNELS, *reversed(KERNELS)):
            if unavailable(kernel):
                continue
            assert use_kernel(model, kernel, keep_dense=True) == 3
            torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(model(one), want_one, rtol=1e-4, atol=1e-5)
    assert weight_bytes(model) >= dense  # packed copies are what a step reads


@pytest.mark.parametrize("kernel", ["linear", "onednn", "mkl", "gemv+onednn"])
def test_engine_gives_the_reference_tokens_with_either_kernel(tiny_checkpoint, kernel):
    if unavailable(kernel):
        pytest.skip(f"{kernel} cannot run here: {unavailable(kernel)}")
    from models.testing import ReferenceModel
    from tests.lm_helpers import case, run

    ref = ReferenceModel(tiny_checkpoint)
    text = case(ref, "text", "Hello there, how are you today?", max_tokens=8)
    engine = make_engine(tiny_checkpoint, cpu_linear=kernel)
    assert engine.linear_kernel == kernel
    assert run(engine, text)["text"].token_ids == text.expected


def test_workers_writing_the_cache_at_once_all_start(tmp_path):
    """Workers that start together on one host (prefill and decode, two LM workers) write the
    same cache file at once: none may fail, and what is left is one whole cache."""
    from concurrent.futures import ThreadPoolExecutor

    from lm_worker.cpu_kernels import _write_cache

    path = tmp_path / "cpu_kernels.json"

    def writer(i: int) -> None:
        for j in range(50):
            _write_cache(path, {f"w{i}": {"kernel": "linear", "ms": {"linear@1": float(j)}}})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))  # re-raises a writer's error
    (entry,) = json.loads(path.read_text()).values()
    assert entry == {"kernel": "linear", "ms": {"linear@1": 49.0}}
    assert [p.name for p in tmp_path.iterdir()] == ["cpu_kernels.json"]  # no temporary left


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(1, 1, True), (7, 63, True), (33, 64, False), (130, 200, True)]
)
def test_gemv_gives_f_linear_s_numbers(n, k, bias, threads, dtype, vector_bits):
    """Every row, whatever the length (the vector loop and its tail), with and without bias,
    on one thread and on two, in fp32 and bf16 (to a unit of bf16's last place), in either
    vector width; a [..., k] input keeps its leading shape."""
    torch.manual_seed(n * k)
    layer = nn.Linear(k, n, bias=bias, dtype=dtype)
    x = torch.randn(1, 1, k, dtype=dtype)
    with torch.inference_mode():
        want = layer(x)
        assert use_kernel(layer, "gemv") == 1
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = layer(x)
        finally:
            torch.set_num_threads(before)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # fp32 sums in another order, each rounded once: at most one unit apart
        assert ((got.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-6).all()
        assert (got == want).float().mean() > 0.9


@needs_gemv
def test_gemv_reads_the_dense_weight_and_batches_run_the_batch_kernel():
    model = mlp()
    dense = weight_bytes(model)
    x, one = torch.randn(4, 64), torch.randn(1, 64)
    with torch.inference_mode():
        want, want_one = model(x), model(one)
        use_kernel(model, "gemv+onednn")
        assert weight_bytes(model) == dense  # a one-row step reads the dense weights
        assert all(m.weight is not None and m.packed_weight is not None for m in model)
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(one), want_one, rtol=1e-4, atol=1e-5)


@needs_gemv
def test_bf16_layers_choose_among_the_kernels_that_take_them(tmp_path):
    model = mlp().to(torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
    assert use_kernel(model, "onednn") == 0  # oneDNN and MKL are offered float32 layers only
    assert "float32 layers only" in cpu_kernels.why_not(model, "gemv+onednn")
    kernel, timings = choose_linear_kernel(model, batch_rows=8, cache_dir=tmp_path)
    assert kernel in ("linear", "gemv") and {"linear@1", "gemv@1", "linear@8"} == set(timings)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want)  # bf16's own tolerance


@pytest.fixture
def gemv_env(monkeypatch):
    """monkeypatch, for the environment the kernel is built in (CC, EPD_CACHE_DIR): the kernel
    is looked for afresh in the test, and again in the real environment after it."""
    cpu_kernels.c_library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernels.c_library.cache_clear()


@pytest.mark.parametrize(
    ("compiler", "reason"),
    [("no-such-compiler-here", "no C compiler"), ("false", "failed")],
)
def test_gemv_that_cannot_be_built_says_why_and_is_not_chosen(gemv_env, tmp_path, compiler, reason):
    gemv_env.setenv("CC", compiler)
    gemv_env.setenv("EPD_CACHE_DIR", str(tmp_path / "cache"))
    assert reason in unavailable("gemv+onednn")
    model = mlp()
    assert use_kernel(model, "gemv") == 0
    assert all(type(m) is nn.Linear for m in model)  # untouched
    kernel, timings = choose_linear_kernel(model, batch_rows=4, cache_dir=tmp_path)
    assert "gemv" not in kernel and "gemv@1" not in timings
    # Asked for by name, it is an error at start-up, not a quiet F.linear.
    with pytest.raises(RuntimeError, match=f"lm.cpu_linear: gemv cannot run here: .*{reason}"):
        from lm_worker.loader import _choose_cpu_kernel

        _choose_cpu_kernel(LMConfig(cpu_linear="gemv"), mlp())


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")
def test_gemv_with_a_cache_it_cannot_write_says_why(gemv_env, tmp_path):
    """A read-only or odd cache directory costs the kernel, not the worker's start-up."""
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    gemv_env.delenv("CC", raising=False)
    gemv_env.setenv("EPD_CACHE_DIR", str(blocker))
    assert "cache" in unavailable("gemv")  # the OSError names the path
    kernel, _ = choose_linear_kernel(mlp(), batch_rows=4)
    assert "gemv" not in kernel


@needs_gemv
def test_the_vector_width_is_measured_once_or_set(gemv_env, tmp_path, caplog):
    """The faster width is measured where none is cached, logged with the timings, cached per
    machine; EPD_CPU_VECTOR_BITS fixes it instead, and a width it is not built in is an error."""
    gemv_env.setenv("EPD_CACHE_DIR", str(tmp_path))
    gemv_env.delenv(cpu_kernels.VECTOR_ENV, raising=False)
    with caplog.at_level("INFO", logger="lm_worker.cpu_kernels"):
        assert cpu_kernels.c_library()[0] is not None
        (entry,) = (v for k, v in cached(tmp_path).items() if k.startswith("vector-"))
        assert entry["bits"] in (512, 256) and "512-bit" in entry["ms"] and "256-bit" in entry["ms"]
        cpu_kernels.c_library.cache_clear()
        cpu_kernels.c_library()
    said = [r.getMessage() for r in caplog.records if "-bit vectors" in r.getMessage()]
    assert said == [
        f"our C kernels run {entry['bits']}-bit vectors ({entry['ms']})",
        f"our C kernels run {entry['bits']}-bit vectors (cached: {entry['ms']})",
    ]
    caplog.clear()
    other = 256 if entry["bits"] == 512 else 512
    gemv_env.setenv(cpu_kernels.VECTOR_ENV, str(other))
    cpu_kernels.c_library.cache_clear()
    with caplog.at_level("INFO", logger="lm_worker.cpu_kernels"):
        cpu_kernels.c_library()
    assert f"run {other}-bit vectors (set by EPD_CPU_VECTOR_BITS)" in caplog.text
    gemv_env.setenv(cpu_kernels.VECTOR_ENV, "128")
    cpu_kernels.c_library.cache_clear()
    with pytest.raises(ValueError, match="EPD_CPU_VECTOR_BITS: one of 512, 256, not '128'"):
        cpu_kernels.c_library()


def cached(cache_dir) -> dict:
    return json.loads((cache_dir / cpu_kernels.CACHE_FILE).read_text())


def test_every_pair_of_kernels_has_one_name_and_back():
    from typing import get_args, get_type_hints

    assert get_args(get_type_hints(LMConfig)["cpu_linear"]) == ("auto", *KERNELS)
    pairs = {kernel_pair(name) for name in KERNELS}
    rows, batches = cpu_kernels.ROW_KERNELS, cpu_kernels.BATCH_KERNELS
    assert pairs == {(row, batch) for row in rows for batch in batches}
    assert len(pairs) == len(KERNELS)
    for name in KERNELS:
        assert cpu_kernels.kernel_name(*kernel_pair(name)) == name
    with pytest.raises(ValueError, match="unknown CPU linear kernel"):
        kernel_pair("gemv+mkl")  # mkl runs one row only


def test_the_kernels_source_ships_with_the_package():
    """A non-editable install (a wheel, the images) builds the kernels from the installed
    source: pyproject's package data must name it."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert cpu_kernels.C_SOURCE.name in pyproject["tool"]["setuptools"]["package-data"]["lm_worker"]
