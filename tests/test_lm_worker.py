"""The LM worker as a real process on loopback, with a real embedded Redis: gRPC in and out,
embeddings from the EC connector, waiting for missing ones, errors, abort, draining."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest

from common.config import load_config
from common.process import Child, epd_command, free_port, port_is_free
from common.served_model import resolve_model
from connector import ECConnector, EmbeddedRedis
from proto import epd_pb2, epd_pb2_grpc
from tests.helpers import RoleProcess, worker_channel, write_config
from tests.lm_helpers import case, case_parts, png


@pytest.fixture(scope="module")
def lm(tmp_path_factory, tiny_checkpoint):
    """A SERVING LM worker process shared by the module's tests (the SIGTERM test, last, ends
    it); yields (stub, a publishing connector, the role)."""
    with EmbeddedRedis() as redis_server:
        metrics_port = free_port()
        path = write_config(
            tmp_path_factory.mktemp("lm") / "cluster.yaml",
            model={"path": str(tiny_checkpoint)},
            connector={"url": redis_server.url},
            lm={
                "kv_cache_bytes": "64MiB",
                "max_num_batched_tokens": 128,
                "max_num_seqs": 8,
                "embedding_timeout_seconds": 3,
                "metrics_port": metrics_port,
            },
        )
        address = f"127.0.0.1:{free_port()}"
        argv = epd_command("lm", "--config", str(path), "--name", "lm", "--listen", address)
        role = RoleProcess("lm", "lm", address, Child("lm", argv))
        try:
            role.wait_status("SERVING", timeout=120)
            fingerprint = resolve_model(load_config(path)).fingerprint
            publisher = ECConnector(redis_server.url, fingerprint, registry=None)
            role.metrics_port = metrics_port
            with worker_channel(role.address) as channel:
                yield epd_pb2_grpc.LanguageModelStub(channel), publisher, role
            publisher.close()
        finally:
            role.child.stop(30)


def lm_request(c, request_id: str | None = None, **sampling) -> epd_pb2.LMGenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    sampling.setdefault("max_tokens", len(c.expected))
    msg = epd_pb2.LMGenerateRequest(
        request_id=request_id or c.request_id,
        prompt_token_ids=c.token_ids,
        sampling=epd_pb2.SamplingParams(**sampling),
    )
    for f in c.features:
        msg.mm_features.add(
            mm_hash=f.mm_hash,
            modality=epd_pb2.MODALITY_IMAGE,
            offset=f.offset,
            length=f.length,
            grid=epd_pb2.GridTHW(t=f.grid_thw[0], h=f.grid_thw[1], w=f.grid_thw[2]),
        )
    return msg


def collect(stream) -> tuple[list[int], list[epd_pb2.LMGenerateResponse]]:
    messages = list(stream)
    return [t for m in messages for t in m.token_ids], messages


def test_text_generation_over_grpc_matches_reference(lm, tiny_ref):
    stub, _, _ = lm
    c = case(tiny_ref, "text-1", "Tell me something short")
    tokens, messages = collect(stub.Generate(lm_request(c), timeout=60))
    assert tokens == c.expected
    last = messages[-1]
    assert last.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(c.token_ids)
    assert last.usage.completion_tokens == len(c.expected)
    assert last.timings.time_to_first_token_seconds > 0
    text = "".join(m.text for m in messages)
    assert text == tiny_ref.tokenizer.decode(c.expected, skip_special_tokens=True)


def test_image_embeddings_come_from_the_connector(lm, tiny_ref):
    stub, publisher, _ = lm
    c = case(tiny_ref, "img-1", "What is this?", [png(84, 56)])
    for mm_hash, tensor in c.embeddings.items():
        assert publisher.put(mm_hash, tensor).stored
    tokens, messages = collect(stub.Generate(lm_request(c), timeout=60))
    assert tokens == c.expected
    assert not any(m.missing_mm_hashes for m in messages)


def test_missing_embedding_is_reported_waited_for_and_completes(lm, tiny_ref):
    stub, publisher, _ = lm
    c = case(tiny_ref, "late-1", "Describe it", [png(56, 84, (9, 9, 200))])
    stream = stub.Generate(lm_request(c), timeout=60)
    first = next(stream)
    assert list(first.missing_mm_hashes) == list(c.embeddings)  # the proxy would re-encode
    for mm_hash, tensor in c.embeddings.items():
        publisher.put(mm_hash, tensor)  # ... and here it is, re-published
    tokens, _ = collect(stream)
    assert tokens == c.expected


def test_a_miss_fails_only_its_own_request(lm, tiny_ref):
    stub, _, _ = lm
    never = case(tiny_ref, "never-1", "Nobody publishes this", [png(56, 56, (1, 2, 3))])
    fine = case(tiny_ref, "fine-1", "Meanwhile, plain text", max_tokens=40)
    results = {}

    def call(c):
        try:
            results[c.request_id] = collect(stub.Generate(lm_request(c), timeout=60))[0]
        except grpc.RpcError as e:
            results[c.request_id] = e

    threads = [threading.Thread(target=call, args=(c,)) for c in (never, fine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["fine-1"] == fine.expected
    error = results["never-1"]
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not arrive within 3s" in error.details()
    # It was prefilled up to its image meanwhile (overlap): its blocks are freed.
    load = _settled_load(stub)
    assert load.running_requests == 0 and load.kv_blocks_used == 0


def _settled_load(stub, timeout: float = 10.0) -> epd_pb2.LMLoad:
    """GetLoad once no request is left in the engine (ends are applied on its thread)."""
    deadline = time.monotonic() + timeout
    load = stub.GetLoad(epd_pb2.GetLoadRequest())
    while (load.running_requests or load.waiting_requests) and time.monotonic() < deadline:
        time.sleep(0.05)
        load = stub.GetLoad(epd_pb2.GetLoadRequest())
    return load


def test_text_before_a_missing_image_is_prefilled_before_it_arrives(lm, tiny_ref):
    stub, publisher, _ = lm
    c = case_parts(
        tiny_ref, "overlap-1", ["A few words ahead of the picture:", png(56, 56, (7, 70, 7)), "?"]
    )
    stream = stub.Generate(lm_request(c), timeout=60)
    first = next(stream)
    assert list(first.missing_mm_hashes) == list(c.embeddings)
    # In the engine already, holding the KV of the text before the image.
    deadline = time.monotonic() + 10
    load = stub.GetLoad(epd_pb2.GetLoadRequest())
    while not (load.running_requests and load.kv_blocks_used) and time.monotonic() < deadline:
        time.sleep(0.02)
        load = stub.GetLoad(epd_pb2.GetLoadRequest())
    assert load.running_requests == 1 and load.kv_blocks_used > 0
    assert load.waiting_for_embeddings == 1
    for mm_hash, tensor in c.embeddings.items():
        publisher.put(mm_hash, tensor)
    tokens, messages = collect(stream)
    assert tokens == c.expected
    timings = messages[-1].timings
    assert 0 < timings.embedding_wait_seconds < timings.time_to_first_token_seconds


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: m.ClearField("prompt_token_ids"), "prompt_token_ids is empty"),
        (lambda m: m.prompt_token_ids.append(10**6), "outside the vocabulary"),
        (lambda m: m.mm_features.add(mm_hash="x", offset=2, length=10**4), "outside the"),
        (lambda m: setattr(m.sampling, "top_p", 1.5), "top_p must be in (0, 1]"),
    ],
)
def test_bad_input_is_invalid_argument(lm, tiny_ref, change, words):
    stub, _, _ = lm
    msg = lm_request(case(tiny_ref, "bad", "Hello"))
    change(msg)
    with pytest.raises(grpc.RpcError) as info:
        collect(stub.Generate(msg, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_abort_and_client_cancel_free_the_request(lm, tiny_ref):
    stub, _, _ = lm
    c = case(tiny_ref, "long-1", "Go on and on")
    stream = stub.Generate(lm_request(c, max_tokens=5000), timeout=60)
    next(stream)
    assert stub.Abort(epd_pb2.AbortRequest(request_id="long-1")).aborted
    _, messages = collect(stream)
    assert messages[-1].finish_reason == epd_pb2.FINISH_REASON_ABORT
    assert not stub.Abort(epd_pb2.AbortRequest(request_id="long-1")).aborted

    # A client that goes away aborts its request too.
    stream = stub.Generate(lm_request(c, "long-2", max_tokens=5000), timeout=60)
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while stub.GetLoad(epd_pb2.GetLoadRequest()).running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    load = stub.GetLoad(epd_pb2.GetLoadRequest())
    assert load.running_requests == 0
    assert load.kv_blocks_total > 0 and load.worker_id == "lm"


def test_abort_while_waiting_for_embeddings_ends_the_request(lm, tiny_ref):
    """Abort used to answer True during the embedding wait and the request ran on anyway
    (to its embeddings' arrival, or the wait's timeout)."""
    stub, publisher, _ = lm
    c = case(tiny_ref, "wait-abort", "Never mind", [png(56, 56, (4, 5, 6))])
    stream = stub.Generate(lm_request(c), timeout=60)
    first = next(stream)
    assert list(first.missing_mm_hashes) == list(c.embeddings)
    assert stub.Abort(epd_pb2.AbortRequest(request_id="wait-abort")).aborted
    for mm_hash, tensor in c.embeddings.items():
        publisher.put(mm_hash, tensor)  # arriving now must not start it
    tokens, messages = collect(stream)
    assert tokens == []
    assert messages[-1].finish_reason == epd_pb2.FINISH_REASON_ABORT
    assert not stub.Abort(epd_pb2.AbortRequest(request_id="wait-abort")).aborted
    assert stub.GetLoad(epd_pb2.GetLoadRequest()).waiting_for_embeddings == 0


def test_nan_temperature_is_refused_and_a_denormal_one_runs_greedily(lm, tiny_ref):
    """Values refused at the edge (NaN temperature) never reach a step; a denormal one samples
    greedily instead of breaking the step for the whole batch."""
    stub, _, _ = lm
    c = case(tiny_ref, "nan-1", "Hot")
    with pytest.raises(grpc.RpcError) as info:
        collect(stub.Generate(lm_request(c, temperature=float("nan")), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be finite" in info.value.details()
    tokens, _ = collect(stub.Generate(lm_request(c, "tiny-1", temperature=1e-40), timeout=60))
    assert tokens == c.expected


def test_metrics_are_served_over_http(lm, tiny_ref):
    stub, _, role = lm
    collect(stub.Generate(lm_request(case(tiny_ref, "metrics-1", "Count me")), timeout=60))
    url = f"http://127.0.0.1:{role.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    assert "epd_lm_time_to_first_token_seconds_count" in text
    assert re.search(r"^epd_lm_generated_tokens_total [1-9]", text, re.M)
    assert "epd_ec_lookups_total" in text  # the connector's, in the same process


def test_sigterm_finishes_requests_in_flight_then_exits(lm, tiny_ref):
    # Last in the module: it ends the shared worker.
    stub, _, role = lm
    c = case(tiny_ref, "drain-1", "Finish what you started", max_tokens=40)
    stream = stub.Generate(lm_request(c), timeout=60)
    first = next(stream)
    role.child.signal(15)
    tokens, messages = collect(stream)
    assert messages[-1].finish_reason == epd_pb2.FINISH_REASON_LENGTH
    assert list(first.token_ids) + tokens == c.expected
    assert role.child.proc.wait(60) == 0
    assert port_is_free("127.0.0.1", int(role.address.rsplit(":", 1)[1]))
