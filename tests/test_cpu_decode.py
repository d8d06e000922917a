"""The fused CPU decode of one sequence (lm_worker/cpu_decode.py, the C in cpu_decode.c): every
decoder layer of a step in one call, held against the torch modules it replaces (logits over
a scattered paged cache, odd head sizes) and, through the engine, against the reference path's
tokens; it takes only the steps of one sequence's one token, and says why where it cannot run."""

from __future__ import annotations

import pytest
import torch

from common.config import LMConfig
from lm_worker import cpu_kernels
from lm_worker.attention import PagedAttentionMetadata
from lm_worker.cpu_decode import FusedDecode, why_not_fused
from lm_worker.loader import build_engine
from models import load_family
from models.testing import make_checkpoint
from tests.lm_helpers import make_engine, run, three_cases

needs_c = pytest.mark.skipif(
    bool(cpu_kernels.c_library()[1]),
    reason=f"our C kernels cannot run here: {cpu_kernels.c_library()[1]}",
)


def _decode_inputs(engine, seq_len: int, block_size: int):
    """A random KV cache, a block table scattered over it for a sequence of `seq_len` tokens
    (its last one new), that token's hidden state and positions."""
    runner = engine.runner
    cache = runner.attention.kv_cache
    cache.normal_()
    torch.manual_seed(seq_len)
    blocks = -(-seq_len // block_size)
    order = torch.randperm(cache.shape[2] - 1)[:blocks] + 1  # never the null block
    table = torch.zeros(1, blocks + 3, dtype=torch.long)  # wider than it needs
    table[0, :blocks] = order
    pos = seq_len - 1
    slot = order[pos // block_size] * block_size + pos % block_size
    meta = PagedAttentionMetadata(
        slot_mapping=slot.reshape(1),
        num_decodes=1,
        decode_block_tables=table,
        decode_seq_lens=torch.tensor([seq_len]),
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_block_tables=[],
    )
    x = torch.randn(1, runner.model.config.hidden_size)
    positions = torch.full((3, 1), pos + 5)  # M-RoPE positions run past the index after media
    return x, positions, meta


@needs_c
@pytest.mark.parametrize("shape", ["tiny", "odd"])
@pytest.mark.parametrize("seq_len", [1, 16, 37])
def test_fused_layers_give_the_modules_logits(tiny_checkpoint, tmp_path, shape, seq_len):
    checkpoint = tiny_checkpoint
    if shape == "odd":  # head_dim 18, intermediate 100: the kernels' tails
        checkpoint = make_checkpoint(
            tmp_path, "qwen2_5_vl", "tiny", seed=3, hidden_size=72, intermediate_size=100,
            mrope_section=(3, 3, 3),
        )  # fmt: skip
    engine = make_engine(checkpoint, cpu_fused_decode="on", block_size=8)
    model, cache = engine.runner.model, engine.runner.attention.kv_cache
    assert model.fused_decode is not None
    x, positions, meta = _decode_inputs(engine, seq_len, block_size=8)
    before = cache.clone()
    with torch.inference_mode():
        fused = model.compute_logits(model(None, positions, x.clone(), meta))
        fused_cache = cache.clone()
        cache.copy_(before)
        model.fused_decode = None
        want = model.compute_logits(model(None, positions, x.clone(), meta))
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)
    # The new token's K / V went to its slot in every layer, as the modules wrote them.
    torch.testing.assert_close(fused_cache, cache, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused_cache, before)


@needs_c
def test_the_engine_on_fused_layers_gives_the_reference_tokens(tiny_checkpoint, tiny_ref):
    cases = three_cases(tiny_ref)
    engine = make_engine(tiny_checkpoint, cpu_fused_decode="on", block_size=8)
    model = engine.runner.model
    fused, taken = model.fused_decode, []

    def counted(x, cos, sin, meta):
        out = fused(x, cos, sin, meta)
        taken.append((x.shape[0], meta.num_decodes, out is not None))
        return out

    model.fused_decode = counted
    for c in cases.values():  # one at a time: every decode step is fused
        assert run(engine, c)[c.request_id].token_ids == c.expected
    steps = sum(len(c.expected) - 1 for c in cases.values())
    assert sum(took for *_, took in taken) == steps
    taken.clear()
    out = run(engine, *cases.values())  # together: batches, and prefill beside decodes
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected
    assert all(took == (tokens == decodes == 1) for tokens, decodes, took in taken)
    assert taken and not any(took for *_, took in taken)  # they finish together


@needs_c
def test_fused_decode_off_and_auto(tiny_checkpoint, caplog):
    assert make_engine(tiny_checkpoint, cpu_fused_decode="off").runner.model.fused_decode is None
    with caplog.at_level("INFO", logger="lm_worker.loader"):
        engine = make_engine(tiny_checkpoint)  # auto: timed against the modules at start-up
    (line,) = [r.getMessage() for r in caplog.records if "decode of one sequence" in r.message]
    fused = engine.runner.model.fused_decode is not None
    assert ("fused C layers" if fused else "torch modules") in line
    assert "ms, modules" in line  # both measured


def test_where_it_cannot_run_it_says_why(tiny_checkpoint, monkeypatch):
    family = load_family(tiny_checkpoint)
    lm = LMConfig(kv_cache_bytes=8 << 20, cpu_fused_decode="on")
    with pytest.raises(RuntimeError, match=r"cpu_fused_decode is on but .*float32"):
        build_engine(lm, family, torch.bfloat16, registry=None)
    engine = make_engine(tiny_checkpoint, cpu_fused_decode="off")
    model, attention = engine.runner.model, engine.runner.attention
    layer = model.layers[0]
    layer.self_attn.qkv_proj, saved = None, layer.self_attn.qkv_proj
    assert "merged projections" in why_not_fused(model, attention)
    layer.self_attn.qkv_proj = saved
    with pytest.raises(ValueError, match="no fused decode"):
        FusedDecode(engine.runner.model.layers, attention)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    cpu_kernels.c_library.cache_clear()
    try:
        assert "no C compiler" in why_not_fused(model, attention)
    finally:
        monkeypatch.undo()
        cpu_kernels.c_library.cache_clear()
