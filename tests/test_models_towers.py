"""Vision towers against transformers' on the same checkpoint: several items of different
sizes (images and video clips) in one forward, fp32, max abs difference <= 1e-5."""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import load_tensors
from models.qwen2_vl.config import load_arch_config
from models.qwen2_vl.vision import VISION_TENSORS, VisionTower
from tests.model_helpers import build_tiny, hf_model

ATOL = 1e-5

GRIDS = {
    "one image": [(1, 8, 12)],
    "images of different sizes": [(1, 4, 4), (1, 10, 6), (1, 2, 16)],
    # windows that do not divide the grid (Qwen2.5-VL pads them in the reference)
    "odd windows": [(1, 6, 10), (1, 14, 2)],
    "video and images": [(2, 6, 8), (1, 4, 6), (3, 4, 4)],
}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def towers(request, tmp_path_factory):
    ckpt = build_tiny(tmp_path_factory.mktemp("towers"), request.param)
    ours = VisionTower.from_checkpoint(ckpt, load_arch_config(ckpt).vision)
    return ours, hf_model(ckpt).model.visual, ckpt


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_tower_equals_reference(towers, grids):
    ours, theirs, _ = towers
    torch.manual_seed(sum(t * h * w for t, h, w in grids))
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = theirs(pixels, grid_thw=grid_thw).pooler_output
    got = ours.embed_multimodal(pixels, grid_thw)
    assert [g.shape[0] for g in got] == [t * h * w // 4 for t, h, w in grids]
    got = torch.cat(got)
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, diff
    assert want.abs().max() > 100 * ATOL  # a real signal, not all zeros
    # One item alone gives the same rows as in the batch.
    first = ours.embed_multimodal(pixels[: grids[0][0] * grids[0][1] * grids[0][2]], grids[:1])
    torch.testing.assert_close(first[0], got[: first[0].shape[0]], atol=ATOL, rtol=0)


def test_tower_dtypes(towers):
    ours, _, ckpt = towers
    torch.manual_seed(0)
    grids = [(1, 8, 8), (2, 4, 6)]
    pixels = torch.randn(64 + 48, 3 * 2 * 14 * 14)
    want = torch.cat(ours.embed_multimodal(pixels, grids))
    for dtype in (torch.bfloat16, torch.float16):
        low = VisionTower.from_checkpoint(ckpt, load_arch_config(ckpt).vision, dtype=dtype)
        assert low.dtype == dtype
        got = torch.cat(low.embed_multimodal(pixels, grids))
        assert got.dtype == dtype
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 0.05, err


def test_tower_loads_no_lm_tensors(towers):
    ours, _, ckpt = towers
    names = set(ours.state_dict())
    assert names == set(load_tensors(ckpt, VISION_TENSORS, "vision"))
    assert not any(n.startswith(("layers.", "embed_tokens", "lm_head")) for n in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_needs_no_mask(dtype):
    """The towers' attention within frames and windows (`_Segments`: segments of one length
    batched, no mask) equals one attention over all tokens with a dense block-diagonal mask,
    the way transformers' eager path builds it."""
    from models.qwen2_vl.vision import _Segments

    lengths = [16, 9, 16, 4, 9, 16, 1]
    n, heads, head_dim = sum(lengths), 4, 80
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    ours = _Segments(lengths).attend(q, k, v)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = segment[:, None] == segment[None, :]
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask
    ).transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, dense, atol=tol, rtol=tol)
