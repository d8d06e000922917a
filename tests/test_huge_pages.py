"""The LM's weights and KV cache on 2 MiB pages (lm_worker/huge_pages.py): the memory it
hands out, parameters moved into it (values and ties kept), and an engine built on it that
says how much the kernel granted and gives the reference tokens either way."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from lm_worker import cpu_kernels, huge_pages
from tests.lm_helpers import make_engine, run, three_cases

granted = pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise"),
    reason=f"this kernel grants no transparent huge pages (mode {huge_pages.thp_mode()!r})",
)


def test_empty_is_zeroed_and_starts_on_a_huge_page():
    t = huge_pages.empty(5 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 5 << 20
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    t.fill_(7)  # writable, its own memory
    assert int(t.sum()) == 7 * (5 << 20)


def test_a_kernel_without_huge_pages_gives_ordinary_memory(monkeypatch):
    def refuse(self, *args):
        raise OSError(22, "Invalid argument")  # madvise on a kernel built without THP

    class Region(mmap.mmap):
        madvise = refuse

    monkeypatch.setattr(huge_pages.mmap, "mmap", Region)
    t = huge_pages.empty(3 << 20)
    assert t.numel() == 3 << 20 and not t.any()


@granted
def test_touched_memory_is_on_huge_pages():
    t = huge_pages.empty(16 << 20).fill_(1)
    ordinary = torch.ones(16 << 20, dtype=torch.uint8)
    assert huge_pages.huge_bytes(t) >= 8 << 20  # the kernel may keep a few frames back
    assert huge_pages.huge_bytes(ordinary) <= huge_pages.huge_bytes(t)


def test_moved_parameters_keep_their_values_and_ties():
    torch.manual_seed(0)
    embed, head = nn.Embedding(300, 48), nn.Linear(48, 300, bias=False)
    head.weight = embed.weight  # tied, as the LM head and the embeddings often are
    model = nn.ModuleDict({"embed": embed, "head": head, "mlp": nn.Linear(48, 96)})
    before = {name: p.clone() for name, p in model.named_parameters()}
    arena = huge_pages.move_parameters(model)
    assert arena is not None and arena.data_ptr() % huge_pages.HUGE_PAGE == 0
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.nbytes
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi, name
        assert p.data_ptr() % 64 == 0, name
    assert model["head"].weight is model["embed"].weight
    # One copy of the tied weight: the arena holds each parameter once.
    assert arena.nbytes < sum(p.nbytes for p in model.parameters()) + 64 * 4
    assert huge_pages.move_parameters(nn.ReLU()) is None


def test_an_engine_on_huge_pages_logs_them_and_gives_the_reference_tokens(
    tiny_checkpoint, tiny_ref, caplog
):
    cases = three_cases(tiny_ref)
    with caplog.at_level("INFO", logger="lm_worker.loader"):
        engine = make_engine(tiny_checkpoint)
    (line,) = [r.getMessage() for r in caplog.records if "on 2 MiB pages" in r.message]
    assert line.startswith("LM weights on 2 MiB pages: ")
    assert engine.runner.attention.kv_cache.data_ptr() % huge_pages.HUGE_PAGE == 0
    out = run(engine, *cases.values())
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected

    caplog.clear()
    with caplog.at_level("INFO", logger="lm_worker.loader"):
        engine = make_engine(tiny_checkpoint, cpu_huge_pages=False)
    assert not [r for r in caplog.records if "on 2 MiB pages" in r.message]
    out = run(engine, *cases.values())
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected


@pytest.mark.skipif(bool(cpu_kernels.unavailable("onednn")), reason="oneDNN is not in this torch")
def test_weights_the_kernel_choice_drops_are_not_copied(tiny_checkpoint):
    """oneDNN for both kernels drops the dense weights (it reads packed copies): the arena holds
    only the parameters left, one after another."""
    engine = make_engine(tiny_checkpoint, cpu_linear="onednn")
    model = engine.runner.model
    assert all(m.weight is None for m in cpu_kernels.linear_layers(model))
    params = list(model.parameters())
    start = min(p.data_ptr() for p in params)
    end = max(p.data_ptr() + p.nbytes for p in params)
    assert end - start <= sum(-(-p.nbytes // 64) * 64 for p in params)
