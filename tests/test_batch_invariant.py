"""`lm.batch_invariant`: a request's logits do not depend on what else is in its batch, how its
prompt was chunked, a preemption, or which request cached its prefix. Held bit for bit: each
sampled token's log-probability, not only the token (a token flips only when two logits are
within rounding of each other; the log-probability shows any difference at all)."""

from __future__ import annotations

import pytest
import torch

from common.config import LMConfig
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import SamplingParams, load_family
from models.testing import make_checkpoint
from tests.lm_helpers import make_engine, run, three_cases

STREAMS = 24
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return list(three_cases(tiny_ref).values())


def streams(cases, n: int = STREAMS) -> list[tuple[Request, dict]]:
    """n requests over the three prompts (text, an image, two images): even ones greedy, odd
    ones sampled with seed i; each asks for its tokens' log-probabilities."""
    out = []
    for i in range(n):
        case = cases[i % len(cases)]
        sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}
        if i % 2:
            sampling |= {"temperature": 0.9, "top_p": 0.95, "seed": i}
        else:
            sampling |= {"temperature": 0.0}
        request = Request(
            f"s{i}", list(case.token_ids), SamplingParams(**sampling), list(case.features)
        )
        out.append((request, case.embeddings))
    return out


def tokens_and_logprobs(collected) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for o in collected.outputs for t in o.logprobs]


def test_the_invariant_forward_gives_the_references_tokens(tiny_checkpoint, cases):
    engine = make_engine(tiny_checkpoint, batch_invariant=True)
    assert engine.runner.invariant is not None and engine.runner.fused is None
    out = run(engine, *cases)
    for case in cases:
        assert out[case.request_id].token_ids == case.expected, case.request_id


def test_24_streams_together_get_what_each_gets_alone(tiny_checkpoint, cases):
    """Alone: one request at a time on one engine (the later ones hit the prefix cache the
    earlier ones left). Together: all 24 at once, prompts cut into chunks of 40 tokens among
    the others', and a KV cache so small that requests are preempted and computed again."""
    alone_engine = make_engine(tiny_checkpoint, batch_invariant=True)
    alone = {}
    for request, embeddings in streams(cases):
        alone |= run(alone_engine, (request, embeddings))
    assert any(c.last.num_cached_tokens > 0 for c in alone.values())  # prefix hits

    per_block = (
        alone_engine.runner.attention.kv_cache[0, 0, 0].nbytes
        * 2
        * len(alone_engine.runner.attention.kv_cache)
    )
    crowd_engine = make_engine(
        tiny_checkpoint,
        batch_invariant=True,
        max_num_seqs=STREAMS,
        max_num_batched_tokens=40,
        kv_cache_bytes=per_block * 60,  # 59 blocks of 16: too few for 24 streams at once
    )
    together = run(crowd_engine, *streams(cases))
    assert crowd_engine.scheduler.num_preemptions > 0

    for i, (request, _) in enumerate(streams(cases)):
        rid = request.request_id
        assert len(alone[rid].token_ids) == MAX_TOKENS
        assert tokens_and_logprobs(together[rid]) == tokens_and_logprobs(alone[rid]), (
            f"stream {i} ({'seeded' if i % 2 else 'greedy'})"
        )


def test_bf16_streams_together_get_what_each_gets_alone(tiny_checkpoint, cases):
    family = load_family(tiny_checkpoint)

    def engine(**lm):
        config = LMConfig(batch_invariant=True, kv_cache_bytes=32 << 20, **lm)
        return build_engine(config, family, torch.bfloat16, registry=None)

    requests = streams(cases, 6)
    bf16 = {k: v.to(torch.bfloat16) for _, e in requests for k, v in e.items()}
    alone = {}
    alone_engine = engine()
    for request, _ in streams(cases, 6):
        alone |= run(alone_engine, (request, bf16))
    together = run(
        engine(max_num_seqs=8, max_num_batched_tokens=24), *[(r, bf16) for r, _ in requests]
    )
    for request, _ in requests:
        rid = request.request_id
        assert tokens_and_logprobs(together[rid]) == tokens_and_logprobs(alone[rid]), rid


def test_a_model_it_cannot_run_is_refused_at_start_up(tmp_path):
    """Voxtral's decoder (sliding-window attention, raw token inputs) is not one our C layers
    run: the worker refuses to start rather than serve without the guarantee."""
    checkpoint = make_checkpoint(tmp_path / "vx", "voxtral_realtime", "tiny")
    with pytest.raises(RuntimeError, match=r"lm\.batch_invariant cannot run here"):
        make_engine(checkpoint, batch_invariant=True)
