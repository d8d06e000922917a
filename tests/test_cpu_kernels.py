"""The CPU linear kernel chosen by measurement: whichever wins, the numbers stay F.linear's, and
the choice is cached per machine and model shape."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lm_worker.cpu_kernels import KERNELS, choose_linear_kernel, use_kernel, weight_bytes
from tests.lm_helpers import make_engine


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
        for kernel in ("onednn", "linear", "mkl", "onednn", "mkl", "linear"):
            use_kernel(model, kernel, keep_dense=True)
            torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(model(one), want_one, rtol=1e-4, atol=1e-5)
    assert weight_bytes(model) >= dense  # packed copies are what a step reads


@pytest.mark.parametrize("kernel", ["linear", "onednn", "mkl"])
def test_engine_gives_the_reference_tokens_with_either_kernel(tiny_checkpoint, kernel):
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
