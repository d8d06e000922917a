"""The inference paths of the shared layers (in place, fewer operations) give the training
paths' numbers bit for bit: the serving model's numerics do not depend on which path ran."""

from __future__ import annotations

import pytest
import torch

from models.layers import (
    GatedMLP,
    RMSNorm,
    apply_rotary,
    apply_rotary_tables,
    rotary_tables,
)


@pytest.mark.parametrize("tokens", [1, 7])
def test_rotary_tables_are_bit_exact(tokens):
    torch.manual_seed(0)
    x = torch.randn(tokens, 14, 64) * 3
    angles = torch.randn(tokens, 64) * 5
    cos, sin = angles.cos(), angles.sin()
    want = apply_rotary(x, cos, sin)
    got = apply_rotary_tables(x, *rotary_tables(cos, sin))
    assert torch.equal(got, want)
    # A view into a wider row (q and k inside the merged qkv output) as the decoder passes it.
    wide = torch.randn(tokens, 16 * 64)
    view = wide[:, : 14 * 64].view(tokens, 14, 64)
    assert torch.equal(
        apply_rotary_tables(view, *rotary_tables(cos, sin)), apply_rotary(view, cos, sin)
    )


def test_rmsnorm_and_mlp_in_place_paths_are_bit_exact():
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96)
    mlp = GatedMLP(96, 160)
    mlp.merge()
    x = torch.randn(5, 96) * 4
    assert torch.is_grad_enabled()  # the training path
    want_norm, want_mlp = norm(x).detach(), mlp(x).detach()
    with torch.no_grad():
        got_norm, got_mlp = norm(x), mlp(x)
    assert torch.equal(got_norm, want_norm) and torch.equal(got_mlp, want_mlp)
    with torch.inference_mode():
        assert torch.equal(norm(x), want_norm) and torch.equal(mlp(x), want_mlp)
