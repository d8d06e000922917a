"""A hostile client on loopback against a cluster without mTLS (issue 58 item 7): the workers'
ports answer only the proxy (common/cluster_auth.py), and an Abort reaches only its caller's
own requests (proxy/server.py)."""

from __future__ import annotations

import re
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.cluster_auth import METADATA_KEY, token_for
from proto import epd_pb2, epd_pb2_grpc
from tests.cluster_helpers import Cluster, image_bytes
from tests.helpers import TEST_CLUSTER_SECRET, wait_until, worker_channel


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(tmp_path_factory.mktemp("worker-auth"), tiny_checkpoint, encoders=1)
    yield c
    c.stop()


def every_method(channel: grpc.Channel, service: str, metadata=None) -> dict[str, grpc.RpcError]:
    """Each method of `service` called with an empty message: its error, by name."""
    descriptor = epd_pb2.DESCRIPTOR.services_by_name[service]
    errors = {}
    for method in descriptor.methods:
        path = f"/{descriptor.full_name}/{method.name}"
        make = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }[method.client_streaming, method.server_streaming]
        call = make(path)  # bytes in, bytes out
        request = iter([b""]) if method.client_streaming else b""
        with pytest.raises(grpc.RpcError) as e:
            reply = call(request, timeout=10, metadata=metadata)
            if method.server_streaming:
                list(reply)
        errors[method.name] = e.value
    return errors


@pytest.mark.parametrize("kind", ["encoder", "lm"])
def test_a_worker_answers_only_the_proxy(cluster, kind):
    address, service = {
        "encoder": (cluster.encoder_addresses[0], "Encoder"),
        "lm": (cluster.lm_address, "LanguageModel"),
    }[kind]
    wrong = token_for(b"not-the-cluster-secret-0000")
    with grpc.insecure_channel(address) as channel:
        # Probes stay open: Kubernetes, `epd health` and the launcher hold no secret.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        for metadata in (None, [(METADATA_KEY, wrong)], [(METADATA_KEY, "")]):
            errors = every_method(channel, service, metadata)
            for name, error in errors.items():
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
                assert "answers only the proxy" in error.details()
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as e:
                list(reflection.ServerReflectionInfo(iter([ask]), timeout=5, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The proxy's token (what tests/helpers.worker_channel sends) is let in.
    with worker_channel(address) as channel:
        stub = getattr(epd_pb2_grpc, f"{service}Stub")(channel)
        assert stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5) is not None
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
        assert f"epd.v1.{service}" in {s.name for s in reply.list_services_response.service}
    assert token_for(TEST_CLUSTER_SECRET.encode()) != TEST_CLUSTER_SECRET  # not the secret


def test_the_proxy_calls_its_workers_with_the_token(cluster):
    """Encode and Generate through the proxy: its every call to a worker carries the token."""
    tokens, last = cluster.generate("What is it?", [image_bytes(64, 64, 2)], max_tokens=3)
    assert len(tokens) == 3 and last.usage.mm_items_encoded == 1


def long_request(request_id: str) -> epd_pb2.GenerateRequest:
    return epd_pb2.GenerateRequest(
        request_id=request_id,
        text="Count forever",
        sampling=epd_pb2.SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0),
    )


class Reader:
    """A Generate stream read in a thread: its finish reasons, one per response."""

    def __init__(self, stub, request: epd_pb2.GenerateRequest):
        self.stream = stub.Generate(request, timeout=120)
        first = next(self.stream)  # running
        self.request_id = first.request_id
        self.finish = [first.finish_reason]
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        for response in self.stream:
            self.finish.append(response.finish_reason)

    def still_running_after(self, responses: int) -> bool:
        """`responses` more responses arrive (an abort ends a stream within a step or two)."""
        seen = len(self.finish)
        wait_until(
            lambda: len(self.finish) >= seen + responses or not self.thread.is_alive(),
            f"{responses} more responses",
        )
        return self.thread.is_alive() and epd_pb2.FINISH_REASON_ABORT not in self.finish

    def aborted(self) -> bool:
        self.thread.join(60)
        return self.finish[-1] == epd_pb2.FINISH_REASON_ABORT


def test_without_keys_an_abort_reaches_only_its_own_connections_requests(cluster):
    """No API keys: another client can neither abort a request by its id nor, by starting one
    under the same id, abort it with its own."""
    address = f"127.0.0.1:{cluster.proxy_grpc}"
    # Another client's own connection (channels in one process share one by default).
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    mine = grpc.insecure_channel(address, options=own_connection)
    theirs = grpc.insecure_channel(address, options=own_connection)
    with mine, theirs:
        my_stub, their_stub = epd_pb2_grpc.InferenceStub(mine), epd_pb2_grpc.InferenceStub(theirs)
        abort = epd_pb2.AbortRequest(request_id="victim")
        victim = Reader(my_stub, long_request("victim"))
        assert not their_stub.Abort(abort, timeout=10).aborted
        assert victim.still_running_after(16)
        # The same id, chosen by the other client: its Abort ends its own request only.
        collider = Reader(their_stub, long_request("victim"))
        assert their_stub.Abort(abort, timeout=10).aborted
        assert collider.aborted()
        assert victim.still_running_after(16)
        assert my_stub.Abort(abort, timeout=10).aborted
        assert victim.aborted()
        # An id the proxy assigns is 128 random bits: nothing to guess.
        unnamed = Reader(my_stub, long_request(""))
        assert re.fullmatch(r"req-[0-9a-f]{32}", unnamed.request_id), unnamed.request_id
        assert my_stub.Abort(epd_pb2.AbortRequest(request_id=unnamed.request_id)).aborted
        assert unnamed.aborted()
