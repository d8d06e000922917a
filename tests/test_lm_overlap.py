"""Encode / prefill overlap in the LM engine: a request admitted before its embeddings are in
is prefilled up to its first item still lacking, stays resident without holding up the rest of
the batch, resumes when the embedding comes, and gives the reference path's tokens; one whose
embedding never comes fails alone and frees its blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lm_worker.block_manager import BlockManager
from lm_worker.request import Request, Status
from lm_worker.scheduler import Scheduler
from models import SamplingParams
from tests.lm_helpers import Collected, case, case_parts, make_engine, png

LONG_TEXT = (
    "Here is a long note before the picture, so that a good part of the prompt comes ahead "
    "of the image and can be prefilled while the image is still being encoded by the tower."
)


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return {
        "before": case_parts(tiny_ref, "before", [LONG_TEXT, png(84, 56), "What is it?"]),
        "two": case_parts(
            tiny_ref,
            "two",
            ["First:", png(56, 56), "and then, after some words,", png(84, 112, (10, 200, 30))],
        ),
        "text": case(tiny_ref, "text", "Meanwhile, a plain text request", max_tokens=12),
    }


def _add(engine, c, embeddings, sinks):
    sinks[c.request_id] = Collected()
    engine.add_request(c.request(), sinks[c.request_id], embeddings, more_to_come=True)


def _request(engine, request_id: str) -> Request:
    return engine.live[request_id].request


@pytest.mark.parametrize("budget", [256, 8])
def test_text_before_an_image_is_prefilled_while_it_encodes(tiny_checkpoint, cases, budget):
    c = cases["before"]
    (f,) = c.features
    assert f.offset > 40  # a real prefix to prefill
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=budget, max_num_seqs=4)
    sinks: dict[str, Collected] = {}
    _add(engine, c, {}, sinks)
    engine.run_to_completion()
    request = _request(engine, c.request_id)
    # Prefilled exactly up to the image; resident, no token out yet.
    assert request.num_computed_tokens == f.offset
    assert request.status is Status.RUNNING and request.block_ids
    assert sinks[c.request_id].outputs == []

    engine.add_embeddings(c.request_id, c.embeddings)
    engine.run_to_completion()
    assert sinks[c.request_id].token_ids == c.expected
    assert sinks[c.request_id].last.finish_reason == "length"


def test_two_images_where_the_second_arrives_late(tiny_checkpoint, cases):
    c = cases["two"]
    first, second = c.features
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=16)
    sinks: dict[str, Collected] = {}
    _add(engine, c, {first.mm_hash: c.embeddings[first.mm_hash]}, sinks)
    engine.run_to_completion()
    # Through the first image and the text after it, up to the second image.
    assert _request(engine, c.request_id).num_computed_tokens == second.offset
    engine.add_embeddings(c.request_id, {second.mm_hash: c.embeddings[second.mm_hash]})
    engine.run_to_completion()
    assert sinks[c.request_id].token_ids == c.expected


def test_a_waiting_request_does_not_hold_up_the_batch(tiny_checkpoint, cases):
    c, text = cases["before"], cases["text"]
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=16)
    sinks: dict[str, Collected] = {}
    _add(engine, c, {}, sinks)
    sinks["text"] = Collected()
    engine.add_request(text.request(), sinks["text"])
    engine.run_to_completion()
    # The text request ran to its end past the resident one; the image request waits.
    assert sinks["text"].token_ids == text.expected
    assert sinks[c.request_id].outputs == []
    engine.add_embeddings(c.request_id, c.embeddings)
    engine.run_to_completion()
    assert sinks[c.request_id].token_ids == c.expected


def test_an_embedding_that_never_comes_fails_its_request_and_frees_its_blocks(
    tiny_checkpoint, cases
):
    c = cases["before"]
    engine = make_engine(tiny_checkpoint, enable_prefix_caching=False)
    sinks: dict[str, Collected] = {}
    _add(engine, c, {}, sinks)
    engine.run_to_completion()
    assert engine.scheduler.blocks.num_used > 0  # the prefix's KV
    engine.fail(c.request_id, "embeddings ['x'] did not arrive within 3s")
    engine.run_to_completion()
    out = sinks[c.request_id].last
    assert out.finish_reason == "error" and out.error_kind == "request"
    assert "did not arrive" in out.error
    assert engine.scheduler.blocks.num_used == 0
    assert not engine.scheduler.has_work() and c.request_id not in engine.live
    assert engine.runner.embeddings.embeds == {} and engine.runner.embeddings.refs == {}
    # Arriving afterwards changes nothing.
    engine.add_embeddings(c.request_id, c.embeddings)
    engine.run_to_completion()
    assert engine.runner.embeddings.embeds == {}


def test_a_late_embedding_that_breaks_the_step_fails_its_request(tiny_checkpoint, cases):
    c = cases["before"]
    (f,) = c.features
    engine = make_engine(tiny_checkpoint, enable_prefix_caching=False)
    sinks: dict[str, Collected] = {}
    _add(engine, c, {}, sinks)
    engine.run_to_completion()
    engine.add_embeddings(c.request_id, {f.mm_hash: torch.zeros(f.length + 1, 3)})
    engine.run_to_completion()
    # (The worker's `load_embedding` refuses this shape before it gets here; past it, the
    # step fails and isolates the request, which frees its blocks like any other end.)
    assert sinks[c.request_id].last.finish_reason == "error"
    assert engine.scheduler.blocks.num_used == 0


def test_without_more_to_come_a_missing_embedding_still_fails_at_once(tiny_checkpoint, cases):
    c = cases["before"]
    engine = make_engine(tiny_checkpoint)
    sink = Collected()
    engine.add_request(c.request(), sink, {})
    engine.run_to_completion()
    assert sink.last.finish_reason == "error" and "not provided" in sink.last.error


def test_a_repeated_image_keeps_its_prefix_hit_while_its_embedding_is_fetched(
    tiny_checkpoint, cases
):
    c = cases["before"]
    (f,) = c.features
    engine = make_engine(tiny_checkpoint, max_num_seqs=4)
    sinks: dict[str, Collected] = {}
    _add(engine, c, c.embeddings, sinks)
    engine.run_to_completion()
    assert sinks[c.request_id].token_ids == c.expected
    # The same prompt again: its blocks through the image are cached, its embedding is not
    # here yet (the worker frees embeddings with their requests and fetches them again).
    again = replace(c, request_id="again", embeddings={})
    _add(engine, again, {}, sinks)
    engine.run_to_completion()
    request = _request(engine, "again")
    assert request.status is Status.WAITING and request.num_computed_tokens == 0
    engine.add_embeddings("again", c.embeddings)
    engine.run_to_completion()
    size = engine.scheduler.blocks.block_size
    assert request.num_cached_tokens >= f.offset + f.length  # the image's KV was reused
    assert request.num_cached_tokens == (len(c.token_ids) - 1) // size * size
    assert sinks["again"].token_ids == c.expected


def test_scheduler_skips_a_waiting_request_with_nothing_ready():
    blocks = BlockManager(num_blocks=16, block_size=4)
    ready = {"blocked": 0}
    scheduler = Scheduler(blocks, 4, 64, lambda r: ready.get(r.request_id, r.num_tokens))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    blocked = Request("blocked", list(range(10)), params)
    other = Request("other", list(range(6)), params)
    scheduler.add(blocked)
    scheduler.add(other)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["other"]
    assert list(scheduler.waiting) == [blocked] and blocked.block_ids == []
    other.num_computed_tokens = 6  # (what the engine's postprocess does)
    other.output_token_ids.append(1)
    # Part of it ready: admitted for that part only, then nothing more until the rest is.
    ready["blocked"] = 7
    batch = scheduler.schedule()
    scheduled = _scheduled(batch)
    assert scheduled == {"other": 1, "blocked": 7}
    other.num_computed_tokens, blocked.num_computed_tokens = 7, 7
    other.output_token_ids.append(1)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["other"]
    assert blocked.status is Status.RUNNING  # resident, holding its prefix's blocks
    other.num_computed_tokens += 1
    other.output_token_ids.append(1)
    ready["blocked"] = 10
    batch = scheduler.schedule()
    scheduled = _scheduled(batch)
    assert scheduled == {"other": 1, "blocked": 3}


def _scheduled(batch) -> dict[str, int]:
    ids = [r.request_id for r in batch.requests]
    return dict(zip(ids, batch.num_scheduled_tokens, strict=True))
