"""The prefill / decode split on a real cluster: one prefill worker, two decode workers, the KV
tier in the embedded Redis. Greedy tokens through P + D equal the reference's (text, one image,
two images, prompts chunked on the prefill worker); a decode worker killed mid-stream loses no
stream and repeats or skips no token, a constrained one (structured outputs) included."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import grpc
import numpy as np
import pytest
import redis

from common.config import load_config
from common.grammar import GrammarCompiler
from common.served_model import resolve_model
from models import MediaInput, MMFeature, Tokenizer
from models.qwen2_vl.family import MRopeState
from models.sampling import Constraint
from models.testing import ImageItem
from proto import epd_pb2, epd_pb2_grpc
from proxy.prepare import ChatMessage, Part, RequestBuilder
from tests.cluster_helpers import Cluster, image_bytes
from tests.helpers import wait_until, worker_channel
from tests.lm_helpers import case, make_engine, run

MAX_TOKENS = 12
ROLES = ("prefill", "decode", "decode")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("pd"),
        tiny_checkpoint,
        encoders=1,
        lms=3,
        lm_roles=ROLES,
        # A budget of 16 tokens a step: every image prompt is prefilled in chunks.
        lm={"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 16},
        proxy={"retries": 4},
    )
    wait_roles(c)
    yield c
    c.stop()


def wait_roles(cluster: Cluster, count: int = 3, timeout: float = 30) -> dict[str, dict]:
    """Until the proxy has `count` LM workers' loads (with their roles): address -> load."""
    deadline = time.monotonic() + timeout
    while True:
        _, state = cluster.http("/dashboard/state")
        loads = {
            w["address"]: w["load"]
            for w in state["workers"]
            if w["role"] == "lm" and w["health"] == "SERVING" and w["load"]
        }
        if len(loads) >= count:
            return loads
        assert time.monotonic() < deadline, state["workers"]
        time.sleep(0.1)


def expected(ref, text: str, images=(), max_tokens: int = MAX_TOKENS) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ref.generate(
        [{"role": "user", "content": content}],
        [ImageItem(b) for b in images],
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def kv_loads(cluster: Cluster, count: int = 3) -> dict[str, dict]:
    """The LM workers' roles and KV counters, as the proxy last polled them, by role name."""
    return by_role(cluster, wait_roles(cluster, count))


def kv_loads_now(cluster: Cluster, count: int = 3) -> dict[str, dict]:
    """kv_loads from a poll after this call (see polled_loads)."""
    return by_role(cluster, polled_loads(cluster, count))


def by_role(cluster: Cluster, loads: dict[str, dict]) -> dict[str, dict]:
    return {
        f"{ROLES[i]}-{i}": loads[address]
        for i, address in enumerate(cluster.lm_addresses)
        if address in loads
    }


# Counters (since the worker started) that the proxy shows of an LM worker's GetLoad answer.
LOAD_COUNTERS = (
    "kv_bytes_sent",
    "kv_blocks_pulled",
    "ec_local_hits",
    "ec_local_misses",
    "ec_redis_hits",
    "ec_redis_misses",
)


def polled_loads(cluster: Cluster, count: int = 3, timeout: float = 30) -> dict[str, dict]:
    """The LM workers' loads as the proxy shows them (address -> load), once it has polled
    every live one after this call: until its view of each worker's counters has reached what
    the worker itself answers now (they only grow)."""
    own = {
        address: own_load(address)
        for i, address in enumerate(cluster.lm_addresses)
        if cluster.roles[f"lm-{i}"].child.poll() is None
    }

    def caught_up() -> dict[str, dict] | None:
        loads = wait_roles(cluster, count)
        fresh = all(
            address in loads
            and all(loads[address].get(k, 0) >= getattr(load, k) for k in LOAD_COUNTERS)
            for address, load in own.items()
        )
        return loads if fresh else None

    return wait_until(caught_up, "a load poll of every LM worker after the event", timeout)


def own_load(address: str) -> epd_pb2.LMLoad:
    """An LM worker's load, asked of it directly."""
    with worker_channel(address) as channel:
        stub = epd_pb2_grpc.LanguageModelStub(channel)
        return stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)


def running_requests(address: str) -> int:
    """An LM worker's running requests, asked of it directly."""
    return own_load(address).running_requests


def outstanding(cluster: Cluster, address: str) -> int:
    """Tokens the proxy has sent the worker at `address` and not seen finish."""
    _, state = cluster.http("/dashboard/state")
    return next(w["outstanding"] for w in state["workers"] if w["address"] == address)


@pytest.mark.parametrize("tail", [1, 9])
def test_positions_past_the_media_from_the_delta_equal_the_full_state(tail):
    """What a decode worker positions with (the prefill's delta alone) equals the full M-RoPE
    state for every token past the last image; without a delta there is no such state."""
    state = MRopeState(None, 64, spatial_merge_size=2, tokens_per_second=None)
    features = [
        MMFeature("a", offset=3, length=16, grid_thw=(1, 8, 8)),
        MMFeature("b", offset=22, length=12, grid_thw=(1, 6, 8)),
    ]
    prompt = 34 + tail  # the last image ends at 34
    full = state.rope_state(prompt, features)
    past = state.rope_past_media(prompt + 1, state.rope_delta(full))  # + the handed-over token
    np.testing.assert_array_equal(
        state.positions(past, prompt + 1, 34, prompt + 5),
        state.positions(full, prompt, 34, prompt + 5),
    )
    with pytest.raises(ValueError):
        state.rope_past_media(prompt + 1, None)


def test_roles_are_reported(cluster):
    loads = kv_loads(cluster)
    assert [load["role"] for load in loads.values()] == list(ROLES)
    assert {load["kv_tier"] for load in loads.values()} == {"shared"}


@pytest.mark.parametrize(
    "text,images",
    [
        ("Tell me a story about the sea", ()),
        ("What is in this picture?", (image_bytes(64, 48, 1),)),
        ("Compare the two", (image_bytes(56, 56, 2), image_bytes(48, 80, 3))),
    ],
    ids=["text", "image", "two-images"],
)
def test_prefill_then_decode_equals_the_reference(cluster, tiny_ref, text, images):
    handovers = cluster.metric("epd_pd_handovers_total")
    tokens, last = cluster.generate(text, images, max_tokens=MAX_TOKENS)
    assert tokens == expected(tiny_ref, text, images)
    assert last.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    # The client's usage counts the handed-over token as output, not prompt.
    assert last.usage.completion_tokens == MAX_TOKENS
    assert cluster.metric("epd_pd_handovers_total") == handovers + 1
    # The decode worker took the whole prompt from the KV tier.
    assert last.usage.cached_prompt_tokens == last.usage.prompt_tokens
    loads = kv_loads_now(cluster)
    prefill = loads["prefill-0"]
    assert prefill["kv_bytes_sent"] > 0
    assert prefill["kv_transfer_p99_seconds"] >= prefill["kv_transfer_p50_seconds"] > 0
    # The decode workers took the media's KV from the tier with the prefill's rope delta:
    # neither has fetched an embedding (the prefill worker has, for the image prompts).
    assert ec_fetches(loads["decode-1"]) == ec_fetches(loads["decode-2"]) == 0
    assert (ec_fetches(prefill) > 0) == bool(images)


def ec_fetches(load: dict) -> int:
    """Embedding lookups a worker made in the EC cache, either tier."""
    keys = ("ec_local_hits", "ec_local_misses", "ec_redis_hits", "ec_redis_misses")
    return sum(int(load.get(k, 0)) for k in keys)


def test_a_decode_worker_missing_the_media_blocks_fetches_the_embeddings(cluster, tiny_ref):
    """A decode stage whose media blocks are not in the tier (text before the image this
    time: no stored chain covers it) fetches the embeddings and positions with its own
    M-RoPE state, whatever rope delta it was sent."""
    served = resolve_model(load_config(cluster.config_path))
    image = image_bytes(64, 48, 1)  # in the EC cache since the image test
    prepared = RequestBuilder(served).build(
        [ChatMessage("user", (Part(text="First this text, then"), Part(media_index=0)))],
        [MediaInput(modality="image", image=image)],
        epd_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    msg = prepared.lm_request()
    msg.request_id = "decode-fallback"
    msg.rope_delta = 10_000  # wrong: used, it would change the tokens
    decode = cluster.lm_addresses[1]
    before = ec_fetches(kv_loads_now(cluster)["decode-1"])
    with worker_channel(decode) as channel:
        stub = epd_pb2_grpc.LanguageModelStub(channel)
        tokens = [t for r in stub.Generate(msg, timeout=60) for t in r.token_ids]
    content = [{"type": "text", "text": "First this text, then"}, {"type": "image"}]
    want = tiny_ref.generate(
        [{"role": "user", "content": content}], [ImageItem(image)], max_tokens=6, ignore_eos=True
    )
    assert tokens == want
    assert ec_fetches(kv_loads_now(cluster)["decode-1"]) > before


def test_one_token_requests_stay_on_one_worker(cluster, tiny_ref):
    handovers = cluster.metric("epd_pd_handovers_total")
    tokens, _ = cluster.generate("Just one", max_tokens=1)
    assert tokens == expected(tiny_ref, "Just one", max_tokens=1)
    assert cluster.metric("epd_pd_handovers_total") == handovers


def constrained_tokens(checkpoint, ref, text: str, regex: str, max_tokens: int) -> list[int]:
    """The greedy tokens of `text` under `regex`, from an engine in this process."""
    c = case(ref, "constrained", text, max_tokens=1)
    request = c.request(ignore_eos=False, max_tokens=max_tokens)
    request.sampling = dataclasses.replace(request.sampling, structured=Constraint("regex", regex))
    engine = make_engine(checkpoint)
    tokenizer = Tokenizer.from_dir(checkpoint)
    grammars = GrammarCompiler(tokenizer.to_json(), engine.vocab_size, sorted(engine.eos_token_ids))
    request.grammar = grammars.matcher(request.sampling.structured)
    return run(engine, (request, c.embeddings))["constrained"].token_ids


def test_kill_9_of_a_decode_worker_mid_stream_loses_no_stream(cluster, tiny_ref, tiny_checkpoint):
    """Six long streams over two decode workers, and a seventh constrained to a regex (its
    grammar's state goes from the prefill to the decode worker, and on to the survivor, by
    replaying its output); one decode worker is killed once every stream has output. Each
    stream completes token-identical to the reference (the constrained one: to an engine's in
    this process): its new decode worker re-prefills from the KV tier (prompt and the blocks
    already decoded)."""
    max_tokens = 800
    texts = [f"Tell me about number {i} at length" for i in range(7)]
    regex = "[a-z ]{600,}"  # no end before max_tokens
    want = [expected(tiny_ref, t, max_tokens=max_tokens) for t in texts[:6]]
    want.append(constrained_tokens(tiny_checkpoint, tiny_ref, texts[6], regex, max_tokens))
    assert len(want[6]) == max_tokens
    results: list[list[int]] = [[] for _ in texts]
    errors: list[str] = []
    done = [False] * len(texts)

    def stream(i: int) -> None:
        sampling = epd_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=i < 6)
        if i == 6:
            sampling.structured.regex = regex
        request = epd_pb2.GenerateRequest(sampling=sampling)
        request.chat.messages.add(role="user", content=[epd_pb2.ContentPart(text=texts[i])])
        try:
            for response in cluster.stub.Generate(request, timeout=90):
                results[i].extend(response.token_ids)
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")
        done[i] = True

    migrations = cluster.metric("epd_migrations_total")
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(7)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(r) >= 20 or d for r, d in zip(results, done, strict=True)):
        assert time.monotonic() < deadline, "the load never got going"
        time.sleep(0.005)
    # The decode worker that runs the most streams dies (a burst need not split evenly), once
    # it reports one: a stream may still be between its prefill and its decode stage.
    while True:
        running = {i: running_requests(cluster.lm_addresses[i]) for i in (1, 2)}
        victim = max(running, key=running.get)
        if running[victim]:
            break
        assert not all(done), "every stream finished before the kill"
        assert time.monotonic() < deadline, f"no decode worker runs a stream: {running}"
        time.sleep(0.005)
    survivor = 3 - victim
    cluster.kill(f"lm-{victim}")
    for t in threads:
        t.join(100)
    assert not errors, errors
    for got, exp in zip(results, want, strict=True):
        assert got == exp
    assert cluster.metric("epd_migrations_total") > migrations
    # The survivor pulled blocks from the tier for the migrated streams.
    assert kv_loads_now(cluster, count=2)[f"decode-{survivor}"]["kv_blocks_pulled"] > 0


def test_a_prefill_worker_dying_before_its_handover_is_retried(cluster, tiny_ref):
    """The prefill worker is frozen with a request in it, then killed: the proxy retries the
    request (no token was sent) on a worker still up, and the client sees the reference's
    tokens. Runs after the decode worker's kill: the cluster is down to one decode worker."""
    retries = cluster.metric("epd_retries_total", role="lm")
    cluster.roles["lm-0"].child.signal(signal.SIGSTOP)
    out: dict = {}

    def call() -> None:
        out["tokens"], out["last"] = cluster.generate("A frozen prefill", max_tokens=6)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_until(
        lambda: outstanding(cluster, cluster.lm_addresses[0]) > 0,
        "the proxy to send the call to the frozen prefill worker",
    )
    cluster.kill("lm-0")
    thread.join(60)
    assert out["tokens"] == expected(tiny_ref, "A frozen prefill", max_tokens=6)
    assert cluster.metric("epd_retries_total", role="lm") > retries


def test_direct_kv_path(tmp_path, tiny_checkpoint, tiny_ref):
    """lm.kv_connector direct: the proxy picks the decode worker before the prefill, and the
    prompt's blocks go straight to it, layer by layer as the chunked prefill computes them;
    Redis holds none of them. Text, one image and two images equal the reference."""
    c = Cluster(
        tmp_path,
        tiny_checkpoint,
        encoders=1,
        lms=2,
        lm_roles=("prefill", "decode"),
        lm={
            "block_size": 8,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 16,
            "kv_connector": "direct",
        },
    )
    try:
        loads = wait_roles(c, count=2)
        assert all(load["kv_tier"] == "direct" for load in loads.values())
        decode_address = loads[c.lm_addresses[1]]["kv_address"]
        assert decode_address.startswith("127.0.0.1:")
        prompt_blocks = 0
        for text, images in (
            ("Tell me a story about the sea", ()),
            ("What is in this picture?", (image_bytes(64, 48, 7),)),
            ("Compare the two", (image_bytes(56, 56, 8), image_bytes(48, 80, 9))),
        ):
            tokens, last = c.generate(text, images, max_tokens=4)
            assert tokens == expected(tiny_ref, text, images, max_tokens=4)
            assert last.usage.cached_prompt_tokens == last.usage.prompt_tokens
            prompt_blocks += -(-last.usage.prompt_tokens // 8)
        with redis.Redis.from_url(c.redis.url) as client:
            stored = sum(1 for _ in client.scan_iter("*:kv:*"))
        assert stored < prompt_blocks  # (the decode worker saves the blocks it fills)
        loads = polled_loads(c, count=2)
        assert loads[c.lm_addresses[0]]["kv_bytes_sent"] > 0
        # Blocks the decode worker held from an earlier prompt (the chat template's) were
        # received, not loaded.
        assert 0 < loads[c.lm_addresses[1]]["kv_blocks_pulled"] <= prompt_blocks
    finally:
        c.stop()
