"""The LM worker: the `LanguageModel` gRPC service over a continuous-batching engine.

The engine (scheduler, paged KV cache, embedding gather, CUDA-graphed decode) lands with the
LM-worker issue; until then the RPCs answer UNIMPLEMENTED and the server does only what every
role does: wait for Redis, report health, drain on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from connector import wait_until_reachable
from epd.config import ClusterConfig
from epd.server import RoleServer, Service, run_role, unimplemented
from proto import epd_pb2, epd_pb2_grpc

logger = logging.getLogger(__name__)

LANDS_WITH = "the LM worker, issue 6"


class LanguageModelServicer(epd_pb2_grpc.LanguageModelServicer):
    async def Generate(self, request: epd_pb2.LMGenerateRequest, context):
        await unimplemented(context, "LanguageModel.Generate", LANDS_WITH)

    async def Abort(self, request: epd_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "LanguageModel.Abort", LANDS_WITH)

    async def GetLoad(self, request: epd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "LanguageModel.GetLoad", LANDS_WITH)


async def serve(config: ClusterConfig, name: str) -> int:
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["LanguageModel"].full_name,
        LanguageModelServicer(),
        epd_pb2_grpc.add_LanguageModelServicer_to_server,
    )
    server = RoleServer(name, config.lm.listen, [service])

    async def load() -> None:
        await wait_until_reachable(config.connector.url, config.connector.startup_wait_seconds)

    return await run_role(server, load, config.lm.drain_timeout_seconds)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
