"""A stuck engine step: the LM worker's watchdog says NOT_SERVING and ends its streams with
UNAVAILABLE (so the proxy migrates them), and says SERVING again once the engine moves on. The
servicer runs in process over a real loopback port and a real embedded Redis; the engine thread
is held by an operation of its own inbox, as a hung kernel would hold it."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ClusterConfig, ConnectorConfig, LMConfig, ModelConfig
from common.process import free_port
from common.server import RoleServer, Service
from lm_worker.server import LanguageModelServicer
from proto import epd_pb2, epd_pb2_grpc


async def health(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5
    )
    return reply.status


async def until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_a_stuck_step_ends_the_streams_and_the_worker_recovers(redis_server, tiny_checkpoint):
    config = ClusterConfig(
        model=ModelConfig(path=str(tiny_checkpoint)),
        connector=ConnectorConfig(url=redis_server.url),
        lm=LMConfig(kv_cache_bytes=32 << 20, step_timeout_seconds=1.0),
    )
    servicer = LanguageModelServicer(config, "lm-watchdog")
    service = Service(
        "epd.v1.LanguageModel", servicer, epd_pb2_grpc.add_LanguageModelServicer_to_server
    )
    server = servicer.role = RoleServer("lm", f"127.0.0.1:{free_port()}", [service])
    port = await server.start()
    release = threading.Event()
    try:
        await servicer.load()
        await server.set_serving()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = epd_pb2_grpc.LanguageModelStub(channel)
            request = epd_pb2.LMGenerateRequest(
                request_id="long",
                prompt_token_ids=list(range(100, 120)),
                sampling=epd_pb2.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
            )
            call = stub.Generate(request, timeout=60)
            first = await call.read()
            assert first.token_ids
            # Hold the engine thread, as a step that never returns would.
            servicer.engine._submit(lambda: release.wait(30))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() != grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stuck" in info.value.details()
            assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

            release.set()

            async def serving() -> bool:
                return await health(channel) == health_pb2.HealthCheckResponse.SERVING

            await until(serving, timeout=10)
            # And it serves again.
            request.request_id = "after"
            request.sampling.max_tokens = 3
            tokens = [t async for r in stub.Generate(request, timeout=30) for t in r.token_ids]
            assert len(tokens) == 3
    finally:
        release.set()
        await servicer.close()
        await server.drain(0)
