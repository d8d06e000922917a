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
from lm_worker.cpu_decode import FusedDecode, choose_fused_decode, why_not_fused
from lm_worker.loader import build_engine
from models import load_family
from models.testing import make_checkpoint
from tests.lm_helpers import make_engine, run, three_cases

needs_c = pytest.mark.skipif(
    bool(cpu_kernels.c_library()[1]),
    reason=f"our C kernels cannot run here: {cpu_kernels.c_library()[1]}",
)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3_checkpoint(tmp_path_factory, request):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), request.param, "tiny", seed=3)


def _decode_inputs(engine, seq_lens: list[int], block_size: int):
    """A random KV cache, block tables scattered over it for sequences of `seq_lens` tokens
    (their last one new; tables wider than they need, in a wider buffer as the runner's), those
    tokens' ids and positions."""
    runner = engine.runner
    cache = runner.attention.kv_cache
    cache.normal_()
    torch.manual_seed(sum(seq_lens))
    need = [-(-n // block_size) for n in seq_lens]
    order = (torch.randperm(cache.shape[2] - 1)[: sum(need)] + 1).tolist()  # not the null block
    buffer = torch.zeros(len(seq_lens) + 2, max(need) + 5, dtype=torch.long)
    tables = buffer[: len(seq_lens), : max(need) + 2]
    slots = []
    for i, (n, blocks) in enumerate(zip(seq_lens, need, strict=True)):
        tables[i, :blocks] = torch.tensor([order.pop() for _ in range(blocks)])
        slots.append(int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(seq_lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(seq_lens),
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_block_tables=[],
    )
    ids = torch.randint(runner.model.config.vocab_size, (len(seq_lens),))
    # M-RoPE positions: past the index after media, each axis its own in general.
    positions = torch.tensor(seq_lens) + torch.tensor([[5], [3], [4]])
    return ids, positions, meta


@needs_c
@pytest.mark.parametrize("whole_step", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["tiny", "odd"])
@pytest.mark.parametrize(
    "seq_lens", [[1], [16], [37], [37, 1, 9], [5, 40, 16, 8, 3, 22, 17, 2], [600, 3, 257]]
)
def test_fused_layers_give_the_modules_logits(
    tiny_checkpoint, tmp_path, shape, seq_lens, dtype, vector_bits, whole_step
):
    """The layers from the embeddings to the final norm (`FusedDecode`'s call), or the whole
    step from the token ids to the logits (`FusedDecode.logits`)."""
    checkpoint = tiny_checkpoint
    if shape == "odd":  # head_dim 18, intermediate 100: the kernels' tails
        checkpoint = make_checkpoint(
            tmp_path, "qwen2_5_vl", "tiny", seed=3, hidden_size=72, intermediate_size=100,
            mrope_section=(3, 3, 3),
        )  # fmt: skip
    _fused_equals_modules(checkpoint, seq_lens, dtype, whole_step)


@needs_c
@pytest.mark.parametrize(("dtype", "whole_step"), [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("seq_lens", [[37, 1, 9], [600, 3, 257]])
def test_fused_qwen3_layers_give_the_modules_logits(qwen3_checkpoint, seq_lens, dtype, whole_step):
    """Qwen3's decoder, dense and MoE (a router's top-k experts in sparse layers, a dense MLP
    in another): per-head q / k norms, head_dim apart from hidden / heads, interleaved
    M-RoPE. In bf16 its normed q / k (entries up to ~4-8, where bf16's unit in the last place
    is 0.016-0.03) carry a norm's scale a bit apart further: twice the bound."""
    _fused_equals_modules(qwen3_checkpoint, seq_lens, dtype, whole_step, bf16_atol=0.04)


def _fused_equals_modules(checkpoint, seq_lens, dtype, whole_step, bf16_atol=0.02) -> None:
    lm = LMConfig(kv_cache_bytes=32 << 20, cpu_fused_decode="on", block_size=8)
    engine = build_engine(lm, load_family(checkpoint), dtype, registry=None)
    model, cache, fused_decode = (
        engine.runner.model,
        engine.runner.attention.kv_cache,
        engine.runner.fused,
    )
    assert fused_decode is not None
    ids, positions, meta = _decode_inputs(engine, seq_lens, block_size=8)
    before = cache.clone()
    with torch.inference_mode():
        x = model.embed_input_ids(ids)
        if whole_step:
            assert fused_decode.whole_step
            fused = fused_decode.logits(ids, positions, meta)
        else:
            fused = model.compute_logits(fused_decode(x.clone(), positions, meta))
        fused_cache = cache.clone()
        cache.copy_(before)
        want = model.compute_logits(model(None, positions, x.clone(), meta))
    # bf16: each value rounded where torch's is, sums in another order (a unit of bf16's last
    # place here and there, carried through the layers).
    bf16 = dtype == torch.bfloat16
    tol = {"rtol": 0, "atol": bf16_atol} if bf16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(fused.float(), want.float(), **tol)
    # The new token's K / V went to its slot in every layer, as the modules wrote them.
    tol = {"rtol": 0.016, "atol": bf16_atol} if bf16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(fused_cache, cache, **tol)
    assert not torch.equal(fused_cache, before)


@needs_c
@pytest.mark.parametrize("whole_step", [True, False])
def test_the_engine_on_fused_layers_gives_the_reference_tokens(
    tiny_checkpoint, tiny_ref, whole_step
):
    """Through the engine, whole steps (token ids to logits in C) or the layers alone."""
    cases = three_cases(tiny_ref)
    engine = make_engine(tiny_checkpoint, cpu_fused_decode="on", block_size=8)
    fused, taken = engine.runner.fused, []
    assert fused.whole_step
    fused.whole_step = whole_step
    takes, steps_taken = fused._takes, []

    def counted(S, meta):  # asked once a step, by either path
        took = takes(S, meta)
        taken.append((S, meta.num_decodes, took))
        return took

    fused._takes = counted
    logits = fused.logits

    def whole(*args):
        out = logits(*args)
        steps_taken.append(out is not None)
        return out

    fused.logits = whole
    for c in cases.values():  # one at a time: every decode step is fused
        assert run(engine, c)[c.request_id].token_ids == c.expected
    steps = sum(len(c.expected) - 1 for c in cases.values())
    assert sum(took for *_, took in taken) == steps
    taken.clear()
    out = run(engine, *cases.values())  # together: decode batches, and prefill beside decodes
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected
    # Steps of decodes only are fused, the others run the modules.
    assert all(took == (tokens == decodes) for tokens, decodes, took in taken)
    assert {(3, 3, True)} <= set(taken) and any(not took for *_, took in taken)
    taken.clear()
    fused.max_seqs = 2  # more sequences than it takes: the modules
    out = run(engine, *cases.values())
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected
    assert (3, 3, False) in taken
    assert any(steps_taken) == whole_step


@needs_c
def test_a_whole_step_wants_ids_in_the_vocabulary_and_a_dense_head(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, cpu_fused_decode="on", block_size=8)
    model, fused_decode = engine.runner.model, engine.runner.fused
    ids, positions, meta = _decode_inputs(engine, [5, 9], block_size=8)
    ids[1] = model.config.vocab_size
    with pytest.raises(ValueError, match="a token id outside the vocabulary"):
        fused_decode.logits(ids, positions, meta)
    ids[1] = 3
    with torch.inference_mode():
        assert fused_decode.logits(ids, positions, meta).shape == (2, model.config.vocab_size)
        model.lm_head.weight = None  # as a packed kernel's choice leaves it: the layers alone
        fused = FusedDecode(model, engine.runner.attention)
        assert not fused.whole_step and fused.logits(ids, positions, meta) is None
        x = model.embed_input_ids(ids)
        assert fused(x, positions, meta).shape == x.shape


@needs_c
def test_fused_decode_off_and_auto(tiny_checkpoint, caplog):
    assert make_engine(tiny_checkpoint, cpu_fused_decode="off").runner.fused is None
    with caplog.at_level("INFO", logger="lm_worker.loader"):
        # auto: timed against the modules at start-up, at 1, 2 and (in place of 4 and 8) 3
        engine = make_engine(tiny_checkpoint, max_num_seqs=3)
    (line,) = [r.getMessage() for r in caplog.records if "CPU decode steps of" in r.message]
    fused = engine.runner.fused
    kept = fused.max_seqs if fused is not None else 0
    assert kept in (0, 1, 2, 3)
    assert (f"1 .. {kept} sequences" if kept else "no sequence count") in line
    assert "1: fused" in line and "4:" not in line  # both measured at one sequence at least


@needs_c
def test_the_choice_is_cached(tiny_checkpoint, tmp_path):
    """Timing a large model's steps takes long: the choice is kept per machine and shape."""
    runner = make_engine(tiny_checkpoint, cpu_fused_decode="off").runner
    model, attention = runner.model, runner.attention
    calls = []

    def step(n: int, fused) -> None:
        calls.append(n)
        runner.dummy_decode(n, fused)

    first, measured = choose_fused_decode(model, attention, step, 4, cache_dir=tmp_path)
    kept = first.max_seqs if first is not None else 0
    assert calls and "cached" not in measured
    calls.clear()
    fused, cached = choose_fused_decode(model, attention, step, 4, cache_dir=tmp_path)
    assert calls == [] and cached == f"cached: {measured}"
    assert (fused.max_seqs if fused is not None else 0) == kept


@needs_c
def test_where_it_cannot_run_it_says_why(tiny_checkpoint, monkeypatch):
    family = load_family(tiny_checkpoint)
    lm = LMConfig(kv_cache_bytes=8 << 20, cpu_fused_decode="on")
    with pytest.raises(RuntimeError, match=r"cpu_fused_decode is on but .*float16"):
        build_engine(lm, family, torch.float16, registry=None)
    engine = make_engine(tiny_checkpoint, cpu_fused_decode="off")
    model, attention = engine.runner.model, engine.runner.attention
    layer = model.layers[0]
    layer.self_attn.qkv_proj, saved = None, layer.self_attn.qkv_proj
    assert "not merged" in why_not_fused(model, attention)
    layer.self_attn.qkv_proj = saved
    with pytest.raises(ValueError, match="no fused decode: ModuleList does not describe"):
        FusedDecode(engine.runner.model.layers, attention)
    if not cpu_kernels.unavailable("onednn"):  # its layers read packed weights only
        cpu_kernels.use_kernel(model, "onednn")
        assert "dense weights were dropped" in why_not_fused(model, attention)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    cpu_kernels.c_library.cache_clear()
    try:
        assert "no C compiler" in why_not_fused(model, attention)
    finally:
        monkeypatch.undo()
        cpu_kernels.c_library.cache_clear()
