"""The KV connector and its shared tier, engine-level: a prefill engine hands a request over to
a decode engine through Redis (the embedded valkey), and the tokens equal the reference's."""

from __future__ import annotations

import pytest
import torch

from connector.kv import HEADER_BYTES, KVStore, decode_block, encode_block, peek_key
from connector.kv_stream import KVInbox, KVReceiver, KVSender
from connector.wire import WireError
from lm_worker.block_manager import extend_block_hashes
from lm_worker.kv_connector import tail_hash
from tests.lm_helpers import Collected, case, make_engine, png, run, three_cases

BLOCK = 8


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return three_cases(tiny_ref)


def shared_engine(checkpoint, redis_url: str, **lm):
    lm.setdefault("block_size", BLOCK)
    store = KVStore(redis_url, "tiny", namespace="t", ttl_seconds=60)
    return make_engine(checkpoint, kv_store=store, **lm)


def generate(
    engine,
    c,
    prompt_extra=(),
    max_tokens=None,
    handover=False,
    request_id=None,
    target="",
    sampling=None,
    text_chars=0,
):
    """Run one case (prompt + `prompt_extra` tokens, earlier output of which the client has
    `text_chars` characters, as the proxy sends a decode stage) through `engine`, prefetching
    its KV from the tier first, as the servicer does; waits for its saves. The Collected
    outputs."""
    request = c.request(**{**(sampling or {}), "max_tokens": max_tokens or len(c.expected)})
    request.request_id = request_id or c.request_id
    request.prompt_token_ids = list(c.token_ids) + list(prompt_extra)
    request.resumed_output_tokens = len(prompt_extra)
    request.resumed_text_chars = text_chars
    engine.kv.prefetch(request, handover=handover, target=target)
    sink = Collected()
    engine.add_request(request, sink, c.embeddings)
    engine.run_to_completion()
    for future in engine.kv.pending_saves(request.request_id):
        future.result(timeout=10)
    return sink


def handover(prefill, decode, c, request_id=None, sampling=None):
    """Prefill's first token, then decode's rest from prompt + that token: the full stream."""
    rid = request_id or c.request_id
    first = generate(prefill, c, max_tokens=1, handover=True, request_id=rid, sampling=sampling)
    assert len(first.token_ids) == 1
    rest = generate(
        decode,
        c,
        first.token_ids,
        max_tokens=len(c.expected) - 1,
        request_id=rid + "-d",
        sampling=sampling,
        text_chars=len(first.text),
    )
    return first.token_ids + rest.token_ids, rest


def blocks(engine) -> dict[str, float]:
    """The engine's KV block counters by result."""
    samples = engine.kv.metrics.blocks.collect()[0].samples
    return {s.labels["result"]: s.value for s in samples if s.name.endswith("_total")}


def test_wire_round_trip_and_checks():
    h = bytes(range(16))
    t = torch.randn(2, 2, BLOCK, 2, 4)
    value = encode_block(h, t, 5)
    block = decode_block(value)
    assert block.block_hash == h and block.num_tokens == 5 and block.num_layers == 2
    assert torch.equal(block.tensor, t)
    bad = bytearray(value)
    bad[HEADER_BYTES + 3] ^= 0xFF
    with pytest.raises(WireError, match="checksum"):
        decode_block(bytes(bad))
    with pytest.raises(WireError, match="length"):
        decode_block(value[:-4])


@pytest.mark.parametrize("name", ["text", "image", "two"])
def test_prefill_then_decode_equals_the_reference(tiny_checkpoint, redis_server, cases, name):
    prefill = shared_engine(tiny_checkpoint, redis_server.url)
    decode = shared_engine(tiny_checkpoint, redis_server.url)
    c = cases[name]
    tokens, rest = handover(prefill, decode, c)
    assert tokens == c.expected
    assert tokens == run(make_engine(tiny_checkpoint, block_size=BLOCK), c)[name].token_ids
    # Every prompt token came from the tier: the decode engine computed only the new one.
    assert rest.last.num_cached_tokens == len(c.token_ids)
    samples = blocks(decode)
    assert samples.get("pulled") == -(-len(c.token_ids) // BLOCK)


def test_a_seeded_sample_continues_across_the_handover(tiny_checkpoint, redis_server, cases):
    # The decode stage draws token i from (seed, i), as one engine would have.
    c = cases["image"]
    sampling = {"temperature": 0.9, "top_k": 40, "seed": 5}
    alone = make_engine(tiny_checkpoint, block_size=BLOCK)
    whole = run(alone, (c.request(**sampling), c.embeddings))[c.request_id].token_ids
    prefill = shared_engine(tiny_checkpoint, redis_server.url)
    decode = shared_engine(tiny_checkpoint, redis_server.url)
    tokens, _ = handover(prefill, decode, c, request_id="seeded", sampling=sampling)
    assert tokens == whole
    assert tokens != c.expected  # it did sample


def test_chunked_prefill_hands_over_every_block(tiny_checkpoint, redis_server, cases):
    # The prefill engine computes the image prompt in chunks of 8 tokens; each chunk's full
    # blocks are saved as the chunk completes.
    prefill = shared_engine(
        tiny_checkpoint, redis_server.url, max_num_batched_tokens=8, max_num_seqs=4
    )
    decode = shared_engine(tiny_checkpoint, redis_server.url)
    c = cases["image"]
    tokens, rest = handover(prefill, decode, c)
    assert tokens == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)


def test_prefix_hit_through_the_shared_tier(tiny_checkpoint, redis_server, cases):
    # One engine computes the prompt; another, with an empty cache, finds its full blocks.
    a = shared_engine(tiny_checkpoint, redis_server.url)
    b = shared_engine(tiny_checkpoint, redis_server.url)
    c = cases["image"]
    assert generate(a, c).token_ids == c.expected
    out = generate(b, c, request_id="again")
    assert out.token_ids == c.expected
    # Full blocks only (no handover, so no tail): all but the last partial block.
    assert out.last.num_cached_tokens == (len(c.token_ids) - 1) // BLOCK * BLOCK


def test_different_image_never_hits(tiny_checkpoint, tiny_ref, redis_server):
    a = shared_engine(tiny_checkpoint, redis_server.url, block_size=4)
    b = shared_engine(tiny_checkpoint, redis_server.url, block_size=4)
    x = case(tiny_ref, "x", "Describe the image", [png(56, 84)], max_tokens=6)
    y = case(tiny_ref, "y", "Describe the image", [png(56, 84, (0, 0, 255))], max_tokens=6)
    assert x.token_ids == y.token_ids
    generate(a, x)
    out = generate(b, y)
    assert out.last.num_cached_tokens <= y.features[0].offset // 4 * 4
    assert out.token_ids == y.expected


def test_corrupt_block_is_recomputed_never_used(tiny_checkpoint, redis_server, cases):
    prefill = shared_engine(tiny_checkpoint, redis_server.url)
    decode = shared_engine(tiny_checkpoint, redis_server.url)
    c = cases["text"]
    generate(prefill, c, max_tokens=1, handover=True)
    # Flip a payload byte of the third block.
    probe = c.request()
    chain = extend_block_hashes(probe, len(c.token_ids), BLOCK)
    store = prefill.kv.store
    value = bytearray(store.get_many([chain[2]])[0])
    value[HEADER_BYTES + 10] ^= 0x55
    store.client.set(store.key(chain[2]), bytes(value))
    first = c.expected[0]
    rest = generate(decode, c, [first], max_tokens=len(c.expected) - 1, request_id="d")
    assert [first, *rest.token_ids] == c.expected
    # Blocks 0 and 1 were used; the corrupt one and everything after were recomputed.
    assert rest.last.num_cached_tokens == 2 * BLOCK
    samples = blocks(decode)
    assert samples["corrupt"] == 1
    assert store.get_many([chain[2]]) != [bytes(value)]  # deleted (or rewritten), not kept


def test_tail_hash_depends_on_tokens_and_media(cases):
    c = cases["image"]
    r1, r2 = c.request(), c.request()
    r2.prompt_token_ids = [*r2.prompt_token_ids[:-1], r2.prompt_token_ids[-1] + 1]
    n = len(c.token_ids)
    assert n % BLOCK
    assert tail_hash(r1, n, BLOCK) != tail_hash(r2, n, BLOCK)
    assert tail_hash(r1, n // BLOCK * BLOCK, BLOCK) is None


def test_direct_path_hands_over_without_redis(tiny_checkpoint, redis_server, cases):
    # The prefill engine sends a handover's blocks over a kept connection to the decode
    # engine's receiver; nothing of the prompt goes through Redis.
    inbox = KVInbox(64 << 20)
    receiver = KVReceiver("127.0.0.1", 0, inbox, peek_key)
    sender = KVSender()
    try:
        prefill = shared_engine(tiny_checkpoint, redis_server.url, kv_direct=(sender, None))
        decode = shared_engine(tiny_checkpoint, redis_server.url, kv_direct=(None, inbox))
        c = cases["image"]
        target = f"127.0.0.1:{receiver.port}"
        first = generate(prefill, c, max_tokens=1, handover=True, target=target)
        assert len(inbox) == -(-len(c.token_ids) // BLOCK)
        rest = generate(decode, c, first.token_ids, max_tokens=len(c.expected) - 1, request_id="d")
        assert first.token_ids + rest.token_ids == c.expected
        assert rest.last.num_cached_tokens == len(c.token_ids)
        assert len(inbox) == 0  # each value is handed out once
        chain = extend_block_hashes(c.request(), len(c.token_ids), BLOCK)
        assert prefill.kv.store.get_many(chain[:1]) == [None]
        assert blocks(prefill)["sent_direct"] == -(-len(c.token_ids) // BLOCK)
        # A second request with the same prompt finds the inbox empty and nothing in Redis
        # for the prompt: it recomputes (a miss, never a wrong block).
        again = generate(decode, c, first.token_ids, max_tokens=3, request_id="again")
        assert again.token_ids == c.expected[1:4]
    finally:
        receiver.close()
        sender.close()


def test_direct_send_to_a_dead_peer_falls_back_to_redis(tiny_checkpoint, redis_server, cases):
    receiver = KVReceiver("127.0.0.1", 0, KVInbox(1 << 20), peek_key)
    target = f"127.0.0.1:{receiver.port}"
    receiver.close()  # nobody listens there now
    prefill = shared_engine(tiny_checkpoint, redis_server.url, kv_direct=(KVSender(1.0), None))
    decode = shared_engine(tiny_checkpoint, redis_server.url)
    c = cases["text"]
    first = generate(prefill, c, max_tokens=1, handover=True, target=target)
    assert blocks(prefill)["direct_failed"] > 0
    rest = generate(decode, c, first.token_ids, max_tokens=len(c.expected) - 1, request_id="d")
    assert first.token_ids + rest.token_ids == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)
