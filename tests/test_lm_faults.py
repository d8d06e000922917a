"""The LM engine under values and loads that used to break it: a temperature that overflows the
logits, a request that breaks its step (it fails alone, the batch goes on), a KV cache smaller
than the context (a request that outgrows it stalled the worker for good), and the choice of
preemption victim."""

from __future__ import annotations

import math

import pytest
import torch

from lm_worker.attention import PagedAttention
from lm_worker.block_manager import BlockManager
from lm_worker.request import Request
from lm_worker.scheduler import Scheduler
from models import SamplingParams
from tests.lm_helpers import case, make_engine, run


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return [
        case(tiny_ref, f"r{i}", f"Say something about {i} things", max_tokens=12) for i in range(3)
    ]


@pytest.mark.parametrize(
    "key,value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -1.0),
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("temperature", "0.5"),
        ("max_tokens", 2.5),
        ("top_k", True),
    ],
)
def test_sampling_params_refuse_non_finite_and_mistyped_values(key, value):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**{key: value})


def test_a_denormal_temperature_samples_greedily(tiny_checkpoint, cases):
    # 1e-40 divides the logits into inf, and softmax(inf) is NaN: every step used to fail.
    engine = make_engine(tiny_checkpoint)
    c = cases[0]
    out = run(engine, (c.request(temperature=1e-40), {}))
    assert out[c.request_id].last.finish_reason == "length"
    assert out[c.request_id].token_ids == c.expected


def test_a_request_that_breaks_its_step_fails_alone(tiny_checkpoint, cases):
    """A value that got past validation (forced in here) breaks the sampler: before, every
    request of the batch failed with it; now the batch is re-run in halves and only the
    offending request fails."""
    engine = make_engine(tiny_checkpoint)
    bad = Request("bad", list(cases[0].token_ids), SamplingParams(temperature=1.0, max_tokens=8))
    object.__setattr__(bad.sampling, "temperature", math.nan)
    out = run(engine, *cases, (bad, {}))
    assert out["bad"].last.finish_reason == "error"
    assert "step failed" in out["bad"].last.error
    assert out["bad"].last.error_kind == "request"
    for c in cases:
        assert out[c.request_id].last.finish_reason == "length", c.request_id
        assert out[c.request_id].token_ids == c.expected, c.request_id
    assert not engine.scheduler.has_work()


def kv_bytes(tiny_ref, blocks: int, block_size: int) -> int:
    cfg = tiny_ref.lm.config
    per_block = PagedAttention.bytes_per_block(
        2, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    return (blocks + 1) * per_block  # + the null block


def test_a_request_outgrowing_the_kv_cache_cannot_stall_the_worker(tiny_checkpoint, tiny_ref):
    """4 blocks of 8 tokens, a 10-token prompt, max_tokens 40: it used to produce 22 tokens and
    then preempt itself forever, and no later request ever ran. Now the context is cut to what
    the cache holds (32 tokens): it ends with `length`, and the next request runs."""
    engine = make_engine(tiny_checkpoint, block_size=8, kv_cache_bytes=kv_bytes(tiny_ref, 4, 8))
    assert engine.max_model_len == 32
    first = Request(
        "long", list(range(1, 11)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    second = Request(
        "next", list(range(1, 6)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    out = run(engine, (first, {}), (second, {}))
    assert out["long"].last.finish_reason == "length"
    assert len(out["long"].token_ids) == 32 - 10
    assert out["next"].last.finish_reason == "length"
    assert len(out["next"].token_ids) == 4


def test_an_explicit_context_larger_than_the_kv_cache_is_refused(tiny_checkpoint, tiny_ref):
    with pytest.raises(RuntimeError, match="not even one request fits"):
        make_engine(
            tiny_checkpoint,
            block_size=8,
            max_model_len=64,
            kv_cache_bytes=kv_bytes(tiny_ref, 4, 8),
        )


def test_the_preemption_victim_is_not_the_request_being_scheduled():
    blocks = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)  # 2 usable
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = Request("a", [1, 2, 3], SamplingParams(temperature=0.0))  # room left in its block
    b = Request("b", [1, 2, 3, 4], SamplingParams(temperature=0.0))  # its block is full
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert first.requests == [a, b] and blocks.num_free == 0
    for request, n in zip(first.requests, first.num_scheduled_tokens, strict=True):
        request.num_computed_tokens += n
        request.output_token_ids.append(5)
    # b needs a second block and none is free: a (the other running request) gives its block,
    # leaving this step, instead of b preempting itself while a runs on.
    second = scheduler.schedule()
    assert second.preempted == [a]
    assert second.requests == [b]
    assert list(scheduler.waiting) == [a]


def test_a_half_computed_block_is_never_offered_for_reuse():
    # A prefill chunk that ends inside a block (a token budget, or a request waiting for an
    # embedding) leaves that block half computed; another request with the same prompt must
    # not take it from the prefix cache, even after the first one is aborted.
    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=6)
    prompt = list(range(1, 14))  # 13 tokens: three full blocks and one more token
    first = Request("first", list(prompt), SamplingParams(temperature=0.0))
    scheduler.add(first)
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == [6]  # blocks 0 (full) and 1 (half) hold its KV
    first.num_computed_tokens += 6
    blocks.commit_full_blocks(first)
    assert first.num_committed_blocks == 1
    scheduler.finish(first, "abort")
    again = Request("again", list(prompt), SamplingParams(temperature=0.0))
    assert len(blocks.cached_prefix(again)) == 1  # only the full one
