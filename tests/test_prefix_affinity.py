"""Prefix-cache affinity (proxy/affinity.py): the proxy's block-hash chain of a prepared prompt
is the LM worker's own, and an LM call goes to the worker holding the longest prefix of its
prompt unless that worker is busier than the margin allows; on real workers, a second request
sharing a long prefix lands where the prefix is cached."""

from __future__ import annotations

import threading
import time

import pytest

from common.block_hash import block_hashes
from common.config import load_config
from common.served_model import resolve_model
from lm_worker.block_manager import BlockManager, extend_block_hashes
from lm_worker.server import to_request
from models import MediaInput
from proto import epd_pb2
from proxy.affinity import Affinity, PrefixIndex, PromptChains
from proxy.pd import PDRouter
from proxy.prepare import ChatMessage, Part, RequestBuilder
from proxy.workers import Breaker, Worker, WorkerPool
from tests.cluster_helpers import Cluster, image_bytes
from tests.helpers import wait_until

BLOCK = 8


@pytest.fixture(scope="module")
def builder(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("affinity") / "cluster.yaml"
    path.write_text(f"model:\n  path: {tiny_checkpoint}\n")
    return RequestBuilder(resolve_model(load_config(path, environ={})))


def prepare(builder, text: str, images=()):
    parts = [Part(media_index=i) for i in range(len(images))] + [Part(text=text)]
    media = [MediaInput(modality="image", image=b) for b in images]
    return builder.build([ChatMessage("user", tuple(parts))], media, epd_pb2.SamplingParams())


@pytest.mark.parametrize(
    "images", [(), (image_bytes(64, 48, 1),), (image_bytes(56, 56, 2), image_bytes(48, 80, 3))]
)
def test_the_proxys_chain_is_the_workers_prefix_cache(builder, images):
    """The proxy hashes the prompt it prepared; the LM worker hashes the request it got from
    that prompt: same chain, and it is what the worker's prefix cache is keyed by."""
    prepared = prepare(builder, "Describe what you see in detail, please", images)
    proxy_chain = PromptChains(prepared.prompt_token_ids, prepared.items).of(BLOCK)
    request = to_request(prepared.lm_request())
    n = request.num_tokens
    assert len(proxy_chain) == n // BLOCK > 0
    assert extend_block_hashes(request, n, BLOCK) == proxy_chain
    # The keys the worker's cache holds once the prompt is computed.
    blocks = BlockManager(num_blocks=64, block_size=BLOCK)
    blocks.allocate(request, n, [])
    request.num_computed_tokens = n
    blocks.commit_full_blocks(request)
    assert set(blocks.cached) == set(proxy_chain)


def test_another_image_behind_the_same_text_is_another_prefix(builder):
    a = prepare(builder, "Same words", (image_bytes(64, 48, 1),))
    b = prepare(builder, "Same words", (image_bytes(64, 48, 2),))
    assert a.prompt_token_ids == b.prompt_token_ids
    chain_a, chain_b = (PromptChains(p.prompt_token_ids, p.items).of(BLOCK) for p in (a, b))
    first_image_block = a.items[0].offset // BLOCK
    assert chain_a[:first_image_block] == chain_b[:first_image_block]
    assert chain_a[first_image_block] != chain_b[first_image_block]


# -- the choice, on workers with set loads ---------------------------------------------------


def lm(address: str, queued: int = 0, role: str = "both", block_size: int = BLOCK) -> Worker:
    w = Worker("lm", address, "static", None, None, Breaker(3, 1.0), status="SERVING")
    w.set_load(
        epd_pb2.LMLoad(
            running_tokens=queued, role=role, prefix_block_size=block_size, kv_blocks_total=100
        )
    )
    return w


def pool_of(*workers: Worker) -> WorkerPool:
    """A real WorkerPool holding these workers (no registry, no polling)."""
    pool = WorkerPool("lm", None, (), None)
    pool.workers.update((w.address, w) for w in workers)
    return pool


PROMPT = list(range(100, 356))  # 32 blocks
CHAINS = PromptChains(PROMPT, [])


def test_the_holder_wins_within_the_margin_and_load_wins_past_it():
    a, b = lm("a:1"), lm("b:1", queued=100)
    affinity = Affinity(max_blocks=1000, margin_tokens=200)
    router = PDRouter(pool_of(a, b), affinity)
    assert router.pick_any(set(), CHAINS) is a  # nobody holds it: least loaded
    affinity.record(b, CHAINS)
    assert router.pick_any(set(), CHAINS) is b  # b holds it, 100 tokens busier: within 200
    b.set_load(epd_pb2.LMLoad(running_tokens=300, role="both", prefix_block_size=BLOCK))
    assert router.pick_any(set(), CHAINS) is a  # 300 busier: past the margin
    # The longest prefix wins between two holders.
    b.set_load(epd_pb2.LMLoad(role="both", prefix_block_size=BLOCK))
    affinity.record(a, PromptChains(PROMPT[:24], []))
    assert router.pick_any(set(), CHAINS) is b
    assert affinity.held_tokens(a, CHAINS) == 24 and affinity.held_tokens(b, CHAINS) == 256
    # Excluded (tried) workers are never chosen.
    assert router.pick_any({"b:1"}, CHAINS) is a


def test_a_short_prefix_is_worth_no_more_queue_than_it_saves():
    """Holding 24 tokens of the prompt (a chat template's head, say) saves 24 tokens of
    prefill: the holder is taken while it is at most 24 tokens busier."""
    a, b = lm("a:1"), lm("b:1", queued=20)
    affinity = Affinity(max_blocks=1000, margin_tokens=2048)
    router = PDRouter(pool_of(a, b), affinity)
    affinity.record(b, PromptChains(PROMPT[:24], []))
    assert router.pick_any(set(), CHAINS) is b
    b.set_load(epd_pb2.LMLoad(running_tokens=30, role="both", prefix_block_size=BLOCK))
    assert router.pick_any(set(), CHAINS) is a


def test_a_worker_without_a_prefix_cache_is_never_preferred():
    a, b = lm("a:1"), lm("b:1", queued=10, block_size=0)
    affinity = Affinity(max_blocks=1000, margin_tokens=200)
    affinity.record(b, CHAINS)  # nothing recorded: b reports no block size
    assert affinity.held_tokens(b, CHAINS) == 0
    assert PDRouter(pool_of(a, b), affinity).pick_any(set(), CHAINS) is a


def test_affinity_applies_to_each_stage_of_the_split():
    p0, p1 = lm("p0:1", role="prefill"), lm("p1:1", queued=50, role="prefill")
    d0, d1 = lm("d0:1", role="decode"), lm("d1:1", queued=50, role="decode")
    affinity = Affinity(max_blocks=1000, margin_tokens=100)
    router = PDRouter(pool_of(p0, p1, d0, d1), affinity)
    assert router.pick("prefill", set(), chains=CHAINS) is p0
    assert router.pick("decode", set(), chains=CHAINS) is d0
    affinity.record(p1, CHAINS)
    affinity.record(d1, CHAINS)
    assert router.pick("prefill", set(), chains=CHAINS) is p1
    assert router.pick("decode", set(), chains=CHAINS) is d1
    # The direct path's target, chosen before the prefill, follows the same rule.
    msg = epd_pb2.LMGenerateRequest(prompt_token_ids=PROMPT)
    d1.load.kv_address = "127.0.0.1:1"
    assert router.cap(msg, CHAINS) is d1 and msg.kv_target == "127.0.0.1:1"
    # Off: the plain rule alone.
    plain = PDRouter(pool_of(p0, p1, d0, d1), Affinity(0, 100))
    plain.record(p1, CHAINS)
    assert plain.pick("prefill", set(), chains=CHAINS) is p0


def test_the_index_is_bounded_and_drops_chain_tails_first():
    index = PrefixIndex(max_blocks=10)
    chain = block_hashes(PROMPT, [], BLOCK)  # 8 blocks
    index.record(chain, "a:1")
    other = block_hashes(list(range(500, 532)), [], BLOCK)  # 4 more: 12 > 10
    index.record(other, "a:1")
    assert len(index) == 10
    # The first chain lost its last two blocks, not its head.
    assert index.matched_blocks(chain, "a:1") == 6
    assert index.matched_blocks(other, "a:1") == 4
    assert index.matched_blocks(chain, "b:1") == 0


# -- real workers ----------------------------------------------------------------------------

SHARED = (
    "Here is a long shared preamble that many requests repeat word for word: "
    + " ".join(f"item{i}" for i in range(60))
    + ". "
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("affinity-cluster"),
        tiny_checkpoint,
        encoders=1,
        lms=2,
        lm={"block_size": BLOCK, "max_num_seqs": 8},
        proxy={"prefix_affinity_margin_tokens": 64},
    )
    wait_loads(c)
    yield c
    c.stop()


def wait_loads(cluster: Cluster, timeout: float = 30) -> None:
    """Until the proxy has both LM workers' loads (their block sizes)."""
    deadline = time.monotonic() + timeout
    while True:
        _, state = cluster.http("/dashboard/state")
        loads = [w["load"] for w in state["workers"] if w["role"] == "lm" and w["load"]]
        if len(loads) == 2:
            return
        assert time.monotonic() < deadline, state["workers"]
        time.sleep(0.1)


def both_idle(cluster: Cluster) -> bool:
    """Whether the proxy sees both LM workers idle: their last polled loads say so and it has
    no work out at either."""
    _, state = cluster.http("/dashboard/state")
    lms = [w for w in state["workers"] if w["role"] == "lm"]
    return len(lms) == 2 and all(
        w["load"]
        and w["queued_tokens"] == 0
        and w["load"]["running_requests"] == w["load"]["waiting_requests"] == 0
        for w in lms
    )


def in_flight(cluster: Cluster, text: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A long request streaming in a thread; returns once its first token is out."""
    out: dict = {"tokens": []}
    first = threading.Event()

    def run() -> None:
        request = epd_pb2.GenerateRequest(
            sampling=epd_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
        request.chat.messages.add(role="user", content=[epd_pb2.ContentPart(text=text)])
        for response in cluster.stub.Generate(request, timeout=60):
            out["tokens"].extend(response.token_ids)
            out["last"] = response
            first.set()
        first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(30)
    return thread, out


def routes(cluster: Cluster, outcome: str) -> float:
    return cluster.metric("epd_prefix_affinity_routes_total", outcome=outcome)


def test_a_shared_prefix_lands_on_the_worker_that_holds_it(cluster, tiny_ref):
    # Another request keeps the worker load alone would pick busy, so the first request with
    # the shared prefix runs on the other one.
    busy, _ = in_flight(cluster, "Something unrelated to the rest", max_tokens=400)
    tokens, _ = cluster.generate(SHARED + "First question?", max_tokens=4)
    busy.join(60)
    wait_until(lambda: both_idle(cluster), "load polls that show both LM workers idle again")
    # Both idle, so load alone would pick the first worker again: affinity picks the holder.
    holders = routes(cluster, "holder")
    _, second = cluster.generate(SHARED + "Second question?", max_tokens=4)
    shared_blocks = len(tiny_ref.tokenizer.encode(SHARED)) // BLOCK
    assert second.usage.cached_prompt_tokens >= shared_blocks * BLOCK > 64
    assert routes(cluster, "holder") == holders + 1
    # Now the holder is busy past the margin (64 tokens) with another prompt sharing the
    # prefix: the next one goes to the idle worker, which never saw the prefix.
    long_one, out = in_flight(cluster, SHARED + "Talk at length.", max_tokens=400)
    by_load = routes(cluster, "load")
    _, third = cluster.generate(SHARED + "Third question?", max_tokens=4)
    assert third.usage.cached_prompt_tokens < shared_blocks * BLOCK // 2
    assert routes(cluster, "load") == by_load + 1
    long_one.join(60)
    assert out["last"].usage.cached_prompt_tokens >= shared_blocks * BLOCK  # (it went there)
    assert len(tokens) == 4
