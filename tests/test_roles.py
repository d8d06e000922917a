"""Every role server: NOT_SERVING until ready, then SERVING over grpc.health.v1; reflection;
clear UNIMPLEMENTED for what later issues fill in; a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.process import free_port, port_is_free
from common.server import RoleServer, Service
from connector import EmbeddedRedis
from proto import epd_pb2, epd_pb2_grpc
from tests.helpers import worker_channel, write_config

SERVICES = {"proxy": "Inference", "encoder": "Encoder", "lm": "LanguageModel"}

# Realtime audio sessions on a model without audio (the tiny Qwen2-VL checkpoint) answer
# FAILED_PRECONDITION, saying why: (service, method, request, streaming, words in the status).
REALTIME_CALLS = {
    "encoder": [
        (
            "Encoder",
            "EncodeStream",
            epd_pb2.EncodeStreamRequest(
                start=epd_pb2.EncodeStreamStart(
                    session_id="s-1", format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=16000
                )
            ),
            True,
            "does not take realtime audio",
        ),
    ],
    "lm": [
        (
            "LanguageModel",
            "Generate",
            epd_pb2.LMGenerateRequest(prompt_token_ids=[1, 2], realtime_session_id="s-1"),
            False,
            "takes no realtime sessions",
        ),
    ],
    "proxy": [
        (
            "Inference",
            "Realtime",
            epd_pb2.RealtimeRequest(
                config=epd_pb2.RealtimeConfig(
                    format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=16000
                )
            ),
            True,
            "does not take realtime audio",
        ),
    ],
}


def list_services(address: str) -> set[str]:
    with worker_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    return {s.name for s in reply.list_services_response.service}


@pytest.mark.parametrize("kind", ["encoder", "lm", "proxy"])
def test_role_health_reflection_and_sigterm(tmp_path, start_role, tiny_checkpoint, kind):
    # Redis is not up yet: the role binds, says NOT_SERVING, and waits for it.
    redis_port = free_port()
    config = write_config(
        tmp_path / "cluster.yaml",
        model={"path": str(tiny_checkpoint)},
        connector={"url": f"redis://127.0.0.1:{redis_port}/0"},
        proxy={"grpc_port": free_port(), "http_port": free_port()},
    )
    role = start_role(kind, config)
    role.wait_status("NOT_SERVING")

    with worker_channel(role.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=f"epd.v1.{SERVICES[kind]}"), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with EmbeddedRedis(port=redis_port):
            # (the model loads and warms up once Redis answers)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

            assert list_services(role.address) >= {
                f"epd.v1.{SERVICES[kind]}",
                "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection",
            }
            for service, method, request, streaming, words in REALTIME_CALLS[kind]:
                stub = getattr(epd_pb2_grpc, f"{service}Stub")(channel)
                with pytest.raises(grpc.RpcError) as info:
                    # Every call listed streams its answer: reading it raises.
                    list(
                        getattr(stub, method)(iter([request]) if streaming else request, timeout=5)
                    )
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert words in info.value.details()

            assert role.terminate() == 0
    assert port_is_free("127.0.0.1", int(role.address.rsplit(":", 1)[1]))


def test_role_exits_with_a_clear_error_when_redis_never_comes(tmp_path, start_role):
    config = write_config(
        tmp_path / "cluster.yaml",
        connector={"url": f"redis://127.0.0.1:{free_port()}/0", "startup_wait_seconds": 0.5},
    )
    role = start_role("encoder", config)
    assert role.child.proc.wait(30) == 1


def test_proxy_lists_the_served_model(tmp_path, start_role, redis_server, tiny_checkpoint):
    config = write_config(
        tmp_path / "cluster.yaml",
        connector={"url": redis_server.url},
        model={"name": "tiny-vl", "path": str(tiny_checkpoint)},
        proxy={"grpc_port": free_port(), "http_port": free_port()},
    )
    role = start_role("proxy", config)
    role.wait_status("SERVING")
    with grpc.insecure_channel(role.address) as channel:
        reply = epd_pb2_grpc.InferenceStub(channel).ListModels(epd_pb2.ListModelsRequest())
    assert [m.id for m in reply.models] == ["tiny-vl"]


class BlockingEncoder(epd_pb2_grpc.EncoderServicer):
    """Holds GetLoad open until released, so the test can watch a drain with work in flight."""

    def __init__(self):
        self.server: RoleServer | None = None
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def GetLoad(self, request, context):
        async with self.server.work(context):
            self.entered.set()
            await self.release.wait()
            return epd_pb2.EncoderLoad(worker_id="drain-test")


async def test_drain_finishes_work_in_flight_and_refuses_new_work():
    servicer = BlockingEncoder()
    service = Service("epd.v1.Encoder", servicer, epd_pb2_grpc.add_EncoderServicer_to_server)
    server = servicer.server = RoleServer("encoder", f"127.0.0.1:{free_port()}", [service])
    port = await server.start()
    await server.set_serving()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = epd_pb2_grpc.EncoderStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        in_flight = asyncio.ensure_future(stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=10))
        await servicer.entered.wait()

        drain = asyncio.create_task(server.drain(timeout=10))
        await asyncio.sleep(0.1)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in info.value.details()
        assert not drain.done()

        servicer.release.set()
        assert (await in_flight).worker_id == "drain-test"
        await asyncio.wait_for(drain, 10)
