"""Tensor parallelism on GPUs (skipped without two): 2 ranks on NCCL, decode in CUDA graphs with
the all-reduces captured inside them, give the same greedy tokens as one GPU, eager and in
graphs; the speed of both is printed with `-s`."""

from __future__ import annotations

import pytest
import torch

from models.testing import make_checkpoint
from tests.test_lm_cuda import engine, generate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_two_gpus_give_one_gpus_tokens(tmp_path, arch):
    path = make_checkpoint(tmp_path / arch, arch, "tiny", seed=1)
    prompts = [[100 + i + j for j in range(20 + 3 * i)] for i in range(6)]
    one = engine(path, "on")
    want, t1 = generate(one, prompts, 32)
    one.stop()
    for graphs in ("off", "on"):
        two = engine(path, graphs, tensor_parallel_size=2)
        try:
            assert (two.runner.graphs is not None) == (graphs == "on")
            got, t2 = generate(two, prompts, 32)
        finally:
            two.stop()
        assert got == want, graphs  # fp32: the partial sums' order moves no greedy token
        print(f"{arch} TP 2 (graphs {graphs}) {t2:.3f}s against TP 1 (graphs) {t1:.3f}s")
