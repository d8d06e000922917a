"""The direct KV path sending layer by layer (lm.kv_send_layerwise), engine-level: a prefill
engine sends each layer of the blocks a step completes to a decode engine's receiver (a real
socket on loopback) while the forward's later layers run; the decode engine takes a block only
once every layer of it is in and checked. Tokens equal the reference's and a worker that does
both; a corrupt, missing or unsent layer is recomputed, never used."""

from __future__ import annotations

import time

import pytest
import torch

from connector.kv import HEADER_BYTES, KVStore, decode_block, encode_block, peek_key
from connector.kv_stream import KVInbox, KVReceiver, KVSender
from lm_worker.block_manager import extend_block_hashes
from lm_worker.kv_connector import tail_hash
from tests.lm_helpers import make_engine, run, three_cases
from tests.test_kv_connector import BLOCK, blocks, generate

CHUNKED = {"max_num_batched_tokens": 8, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return three_cases(tiny_ref)


@pytest.fixture(scope="module")
def both_tokens(tiny_checkpoint, cases):
    """Each case's tokens from one engine doing both prefill and decode."""
    engine = make_engine(tiny_checkpoint, block_size=BLOCK)
    return {name: run(engine, c)[name].token_ids for name, c in cases.items()}


class Direct:
    """A receiver with its inbox (the decode side) and a sender (the prefill side)."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.inbox = KVInbox(max_bytes)
        self.receiver = KVReceiver("127.0.0.1", 0, self.inbox, peek_key)
        self.sender = KVSender(2.0)
        self.target = f"127.0.0.1:{self.receiver.port}"

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def direct():
    d = Direct()
    yield d
    d.close()


def engines(checkpoint, redis_url: str, d: Direct, layerwise: bool = True, **prefill_lm):
    def store():
        return KVStore(redis_url, "tiny", namespace="lw", ttl_seconds=60)

    prefill = make_engine(
        checkpoint,
        block_size=BLOCK,
        kv_store=store(),
        kv_direct=(d.sender, None),
        kv_send_layerwise=layerwise,
        **prefill_lm,
    )
    decode = make_engine(checkpoint, block_size=BLOCK, kv_store=store(), kv_direct=(None, d.inbox))
    return prefill, decode


def num_layers(engine) -> int:
    return engine.runner.attention.kv_cache.shape[0]


def hashes_of(c) -> list[bytes]:
    """The prompt's block hashes as a handover sends them: full blocks, then the tail."""
    n = len(c.token_ids)
    probe = c.request()
    chain = extend_block_hashes(probe, n, BLOCK)[: n // BLOCK]
    tail = tail_hash(probe, n, BLOCK)
    return chain + ([tail] if tail is not None else [])


def decode_rest(decode, c, first):
    return generate(decode, c, first.token_ids, max_tokens=len(c.expected) - 1, request_id="d")


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", ["text", "image", "two"])
def test_layerwise_handover_equals_both_and_the_reference(
    tiny_checkpoint, redis_server, cases, both_tokens, direct, name, chunked
):
    lm = CHUNKED if chunked else {}
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct, **lm)
    c = cases[name]
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    # Every block arrived as one value per layer, each acknowledged before the handover.
    nblocks = -(-len(c.token_ids) // BLOCK)
    assert len(direct.inbox) == nblocks
    assert direct.inbox.num_values() == nblocks * num_layers(prefill)
    rest = decode_rest(decode, c, first)
    tokens = first.token_ids + rest.token_ids
    assert tokens == c.expected == both_tokens[name]
    assert rest.last.num_cached_tokens == len(c.token_ids)  # the whole prompt from the inbox
    assert blocks(prefill)["sent_direct"] == nblocks
    assert "saved" not in blocks(prefill)  # nothing of the prompt through Redis
    assert blocks(decode)["pulled"] == nblocks


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "per-step"])
def test_blocks_the_prefill_held_already_are_sent_too(
    tiny_checkpoint, redis_server, cases, direct, layerwise
):
    """The second prompt shares the chat template's blocks with the first: the prefill engine
    has them cached, but the decode engine that takes the second has not: they are sent."""
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct, layerwise)
    generate(prefill, cases["text"], max_tokens=1, handover=True, target=direct.target)
    direct.inbox.take_many(hashes_of(cases["text"]), num_layers(prefill))  # a first decoder's
    c = cases["image"]
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    assert first.last.num_cached_tokens >= BLOCK  # the template, from the local prefix cache
    rest = decode_rest(decode, c, first)
    assert first.token_ids + rest.token_ids == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)


def test_layers_go_out_while_the_forward_still_runs(tiny_checkpoint, redis_server, cases, direct):
    """The forward's last layer waits until the decode side holds layer 0 of the first block:
    that only ends if layer 0 was sent before the forward was over (else: a timeout)."""
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["image"]
    last = num_layers(prefill) - 1
    first_hash = hashes_of(c)[0]
    seen = []
    save_layer = prefill.kv.save_kv_layer

    def waiting_save_layer(layer, layer_kv):
        if layer == last and not seen:
            deadline = time.monotonic() + 10
            while not _holds_layer(direct.inbox, first_hash, 0):
                assert time.monotonic() < deadline, "layer 0 was not sent during the forward"
                time.sleep(0.002)
            seen.append(layer)
        save_layer(layer, layer_kv)

    prefill.kv.save_kv_layer = waiting_save_layer
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    assert seen == [last]
    rest = decode_rest(decode, c, first)
    assert first.token_ids + rest.token_ids == c.expected


def _holds_layer(inbox: KVInbox, block_hash: bytes, layer: int) -> bool:
    with inbox._lock:
        return layer in inbox._blocks.get(block_hash, {})


def handover_taken(prefill, c, direct):
    """A handover's first token, and its blocks' values taken back out of the decode side's
    inbox (per block, per layer): a test alters them and sends them again."""
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    return first, direct.inbox.take_many(hashes_of(c), num_layers(prefill))


def test_a_corrupt_layer_is_recomputed_never_used(tiny_checkpoint, redis_server, cases, direct):
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["text"]
    # Layer 1 of the third block, one payload byte flipped, sent over the wire in place of
    # the good one (the other values are sent back as they were).
    first, taken = handover_taken(prefill, c, direct)
    assert all(values is not None for values in taken)
    bad = bytearray(taken[2][1])
    assert decode_block(bytes(bad)).first_layer == 1
    bad[HEADER_BYTES + 10] ^= 0x55
    taken[2][1] = bytes(bad)
    direct.sender.send(direct.target, [v for values in taken for v in values])
    rest = decode_rest(decode, c, first)
    assert first.token_ids + rest.token_ids == c.expected
    # Blocks 0 and 1 were used; the corrupt one and everything after were recomputed.
    assert rest.last.num_cached_tokens == 2 * BLOCK
    assert blocks(decode)["corrupt"] == 1


def test_a_block_missing_a_layer_is_a_miss(tiny_checkpoint, redis_server, cases, direct):
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["image"]
    first, taken = handover_taken(prefill, c, direct)
    del taken[1][-1]  # block 1 without its last layer
    direct.sender.send(direct.target, [v for values in taken for v in values])
    rest = decode_rest(decode, c, first)
    assert first.token_ids + rest.token_ids == c.expected
    assert rest.last.num_cached_tokens == BLOCK
    assert direct.inbox.incomplete == 1
    assert "corrupt" not in blocks(decode)


def test_a_prefill_dying_mid_forward_leaves_no_usable_block(
    tiny_checkpoint, redis_server, cases, direct
):
    """The prefill fails after half its layers went out: the decode side holds those layers
    of every block, never all of them, and the request computed there from scratch is right."""
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["two"]
    half = num_layers(prefill) // 2
    save_layer = prefill.kv.save_kv_layer

    def dying_save_layer(layer, layer_kv):
        if layer == half:
            raise RuntimeError("the prefill worker died")
        save_layer(layer, layer_kv)

    prefill.kv.save_kv_layer = dying_save_layer
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    assert first.token_ids == [] and first.last.finish_reason == "error"
    _wait(lambda: direct.inbox.num_values() == len(hashes_of(c)) * half)
    # The same request, now on the decode side: every block is incomplete, so recomputed.
    out = generate(decode, c, request_id="again")
    assert out.token_ids == c.expected
    assert out.last.num_cached_tokens == 0
    assert direct.inbox.incomplete >= 1


def test_a_receiver_dying_mid_forward_sends_the_blocks_to_redis(
    tiny_checkpoint, redis_server, cases, direct
):
    """The decode worker's receiver goes away after a few layers: the rest of the sends and
    the resend fail, and the step's full blocks go to Redis, where a decode worker finds them."""
    prefill, _ = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["image"]
    save_layer = prefill.kv.save_kv_layer

    def closing_save_layer(layer, layer_kv):
        if layer == 1:
            direct.receiver.close()
        save_layer(layer, layer_kv)

    prefill.kv.save_kv_layer = closing_save_layer
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    nblocks = len(hashes_of(c))
    assert blocks(prefill)["direct_failed"] == nblocks
    assert blocks(prefill)["saved"] == nblocks
    other = make_engine(
        tiny_checkpoint,
        block_size=BLOCK,
        kv_store=KVStore(redis_server.url, "tiny", namespace="lw", ttl_seconds=60),
    )
    rest = decode_rest(other, c, first)
    assert first.token_ids + rest.token_ids == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)


def test_layerwise_off_sends_whole_blocks_after_each_step(
    tiny_checkpoint, redis_server, cases, direct
):
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct, layerwise=False, **CHUNKED)
    c = cases["image"]
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    nblocks = len(hashes_of(c))
    assert direct.inbox.num_values() == nblocks  # one value per block, all layers
    rest = decode_rest(decode, c, first)
    assert first.token_ids + rest.token_ids == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)


def test_kv_metrics_count_the_layer_values(tiny_checkpoint, redis_server, cases, direct):
    prefill, decode = engines(tiny_checkpoint, redis_server.url, direct)
    c = cases["text"]
    first = generate(prefill, c, max_tokens=1, handover=True, target=direct.target)
    _wait(lambda: direct.receiver.bytes_received > 0)
    sent = prefill.kv.metrics.bytes.labels("sent")._value.get()
    assert sent == direct.receiver.bytes_received == direct.inbox.nbytes
    decode_rest(decode, c, first)
    assert decode.kv.metrics.bytes.labels("received")._value.get() == sent
    assert prefill.kv.metrics.percentiles()[0] > 0  # the step's send time


# -- the wire pieces ---------------------------------------------------------------------------


def test_inbox_hands_a_block_out_only_with_every_layer():
    h = bytes(range(16))
    t = torch.randn(3, 2, BLOCK, 2, 4)
    inbox = KVInbox(1 << 20)
    for layer in (2, 0):
        value = encode_block(h, t[layer : layer + 1], BLOCK, layer)
        inbox.put(h, value, *peek_key(value)[1:])
    assert inbox.take_many([h], 3) == [None]  # layer 1 missing: a miss, and dropped
    assert inbox.incomplete == 1 and len(inbox) == 0 and inbox.nbytes == 0
    values = [encode_block(h, t[i : i + 1], BLOCK, i) for i in range(3)]
    for value in reversed(values):
        inbox.put(h, value, *peek_key(value)[1:])
    assert inbox.take_many([h], 3) == [values]  # in layer order
    whole = encode_block(h, t, BLOCK)
    inbox.put(h, whole, *peek_key(whole)[1:])
    assert inbox.take_many([h, bytes(16)], 3) == [[whole], None]


def test_a_batch_whose_connection_was_replaced_is_not_acknowledged(direct):
    value = encode_block(bytes(16), torch.zeros(1, 4), 1)
    epoch = direct.sender.send_frames(direct.target, [value])
    direct.sender.finish(direct.target, epoch)
    epoch = direct.sender.send_frames(direct.target, [value])
    direct.sender._drop(direct.target)  # as a failed write of another thread would
    with pytest.raises(ConnectionError):
        direct.sender.send_frames(direct.target, [value], epoch)
    with pytest.raises(ConnectionError):
        direct.sender.finish(direct.target, epoch)


def _wait(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)
