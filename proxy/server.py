"""The proxy: the cluster's front door. gRPC `Inference` and the HTTP API in one process.

Hashing, cache-aware scheduling and routing land with the proxy issue; until then Generate,
Realtime and Abort answer UNIMPLEMENTED, and ListModels, /v1/models, /health and /metrics
answer for real.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc

from connector import wait_until_reachable
from epd.config import ClusterConfig
from epd.server import RoleServer, Service, run_role, unimplemented
from proto import epd_pb2, epd_pb2_grpc
from proxy.http import HttpApi

logger = logging.getLogger(__name__)

LANDS_WITH = "the proxy, issue 7"


def model_card(config: ClusterConfig) -> epd_pb2.ModelCard:
    card = epd_pb2.ModelCard(id=config.model.served_name)
    if config.model.path is not None:
        hf_config = json.loads((Path(config.model.path) / "config.json").read_text())
        card.architecture = (hf_config.get("architectures") or [""])[0]
    return card


class InferenceServicer(epd_pb2_grpc.InferenceServicer):
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.card = model_card(config)

    async def Generate(self, request: epd_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Inference.Generate", LANDS_WITH)

    async def Realtime(self, request_iterator, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Inference.Realtime", LANDS_WITH)

    async def Abort(self, request: epd_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Inference.Abort", LANDS_WITH)

    async def ListModels(self, request, context) -> epd_pb2.ListModelsResponse:
        return epd_pb2.ListModelsResponse(models=[self.card])


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = InferenceServicer(config)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        servicer,
        epd_pb2_grpc.add_InferenceServicer_to_server,
    )
    listen = f"{config.proxy.host}:{config.proxy.grpc_port}"
    server = RoleServer(name, listen, [service])
    http = HttpApi(servicer.card)

    async def load() -> None:
        await http.start(config.proxy.host, config.proxy.http_port)
        await wait_until_reachable(config.connector.url, config.connector.startup_wait_seconds)

    async def on_serving() -> None:
        http.serving = True

    async def on_drain() -> None:
        http.serving = False

    try:
        return await run_role(
            server,
            load,
            config.proxy.drain_timeout_seconds,
            on_serving=on_serving,
            on_drain=on_drain,
        )
    finally:
        await http.stop()


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
