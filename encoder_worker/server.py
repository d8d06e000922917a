"""The encoder worker: the `Encoder` gRPC service over the checkpoint's media encoders.

Its loop (`execute_mm_encoder`: prepare -> batch -> run the tower -> publish by mm_hash) lands
with the encoder-worker issue; until then the RPCs answer UNIMPLEMENTED and the server does only
what every role does: wait for Redis, report health, drain on SIGTERM.
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

LANDS_WITH = "the encoder worker, issue 5"


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    async def Encode(self, request: epd_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Encoder.Encode", LANDS_WITH)

    async def EncodeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Encoder.EncodeStream", LANDS_WITH)

    async def GetLoad(self, request: epd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Encoder.GetLoad", LANDS_WITH)


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = EncoderServicer()
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
        servicer,
        epd_pb2_grpc.add_EncoderServicer_to_server,
    )
    server = RoleServer(name, config.encoder.listen, [service])

    async def load() -> None:
        await wait_until_reachable(config.connector.url, config.connector.startup_wait_seconds)

    return await run_role(server, load, config.encoder.drain_timeout_seconds)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
