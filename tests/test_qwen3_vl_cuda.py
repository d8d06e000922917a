"""GPU checks for Qwen3-VL-MoE (skipped without CUDA): decode batches in CUDA graphs (the MoE
layers' static dense path inside them) give eager decode's tokens and the reference's."""

from __future__ import annotations

import pytest

from models.testing import ReferenceModel, make_checkpoint
from tests.test_lm_cuda import engine, generate

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("batch", [1, 5])
def test_moe_graph_decode_matches_eager_and_reference(tmp_path, batch):
    checkpoint = make_checkpoint(tmp_path / "moe", "qwen3_vl_moe", "tiny", seed=2)
    prompts = [[100 + i + j for j in range(20 + i)] for i in range(batch)]
    graphed = engine(checkpoint, "on")
    assert graphed.runner.graphs is not None and graphed.runner.graph_sizes[-1] >= batch
    want, _ = generate(engine(checkpoint, "off"), prompts, 24)
    got, _ = generate(graphed, prompts, 24)
    assert got == want
    ref = ReferenceModel(checkpoint, device="cuda")
    assert got[0] == ref.generate(prompts[0], max_tokens=24, ignore_eos=True)
