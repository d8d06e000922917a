"""The encoder worker: the `Encoder` gRPC service over `MMEncoder` (encoder_worker/encoder.py).

Per Encode call: convert the request (protobuf stops here; an item that cannot be read fails
alone) -> `execute_mm_encoder` -> one EncodeResult per item, in request order. The call itself
fails only when the worker cannot serve (loading, draining).

Life cycle (common/server.py): NOT_SERVING until the tower has loaded and run a warm-up encode;
SERVING; on SIGTERM new calls get UNAVAILABLE while every accepted item is still encoded and
published, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from common.config import ClusterConfig
from common.media import media_from_proto
from common.server import RoleServer, Service, run_worker, unimplemented
from connector import AsyncECConnector, wait_until_reachable
from connector.registry import Heartbeat
from encoder_worker.encoder import EncodeItem, ItemResult, MMEncoder
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.tower import Tower, load_tower
from models import MediaError
from proto import epd_pb2, epd_pb2_grpc

logger = logging.getLogger(__name__)

STATUS_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
OUTCOMES = {
    "stored": epd_pb2.ENCODE_OUTCOME_STORED,
    "held": epd_pb2.ENCODE_OUTCOME_HELD,
    "failed": epd_pb2.ENCODE_OUTCOME_FAILED,
}
DTYPES = {
    torch.float32: epd_pb2.DTYPE_FLOAT32,
    torch.float16: epd_pb2.DTYPE_FLOAT16,
    torch.bfloat16: epd_pb2.DTYPE_BFLOAT16,
}


def to_items(request: epd_pb2.EncodeRequest) -> list[EncodeItem | ItemResult]:
    """Each proto item as an EncodeItem, or as its failed result when it cannot be read."""
    out: list[EncodeItem | ItemResult] = []
    for item in request.items:
        try:
            out.append(EncodeItem(item.mm_hash, media_from_proto(item.media)))
        except MediaError as e:
            out.append(ItemResult.failed(item.mm_hash, "invalid_argument", e.reason, 0.0))
    return out


def to_result(r: ItemResult, dtype: torch.dtype) -> epd_pb2.EncodeResult:
    msg = epd_pb2.EncodeResult(
        mm_hash=r.mm_hash,
        outcome=OUTCOMES[r.outcome],
        num_embeddings=r.num_embeddings,
        width=r.width,
        dtype=DTYPES[r.dtype or dtype],
        nbytes=r.nbytes,
        encode_seconds=r.encode_seconds,
    )
    if r.outcome == "failed":
        msg.error.code = STATUS_CODES[r.error_kind].value[0]
        msg.error.message = r.error
    return msg


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    def __init__(
        self, config: ClusterConfig, name: str, registry: CollectorRegistry | None = REGISTRY
    ):
        self.config = config
        self.name = name
        self.registry = registry
        self.role: RoleServer | None = None
        self.tower: Tower | None = None
        self.connector: AsyncECConnector | None = None
        self.encoder: MMEncoder | None = None

    async def load(self) -> None:
        """Redis reachable, the tower loaded and warm, the batch loop running."""
        c = self.config
        await wait_until_reachable(
            c.connector.url, c.connector.startup_wait_seconds, c.connector.mode
        )
        self.tower, served = await asyncio.to_thread(load_tower, c)
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint,
            registry=self.registry,
            **c.connector.connector_options(),
        )
        encoder = MMEncoder(self.tower, self.connector, c.encoder, EncoderMetrics(self.registry))
        encoder.start()
        self.encoder = encoder
        logger.info("encoding %s (fingerprint %s)", served.name, served.fingerprint)

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.close()
        if self.connector is not None:
            await self.connector.close()

    async def Encode(
        self, request: epd_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> epd_pb2.EncodeResponse:
        async with self.role.work(context):
            if self.encoder is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is still loading")
            converted = to_items(request)
            unreadable = sum(isinstance(c, ItemResult) for c in converted)
            if unreadable:
                self.encoder.metrics.error["invalid_argument"].inc(unreadable)
            items = [c for c in converted if isinstance(c, EncodeItem)]
            encoded = iter(await self.encoder.execute_mm_encoder(items))
            results = [c if isinstance(c, ItemResult) else next(encoded) for c in converted]
            logger.debug(
                "request %s: %s", request.request_id, ", ".join(r.outcome for r in results)
            )
            dtype = self.tower.dtype
            return epd_pb2.EncodeResponse(results=[to_result(r, dtype) for r in results])

    async def EncodeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        await unimplemented(context, "Encoder.EncodeStream", "the realtime audio encoder")

    async def GetLoad(
        self, request: epd_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> epd_pb2.EncoderLoad:
        if self.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is still loading")
        load = self.encoder.load()
        return epd_pb2.EncoderLoad(
            worker_id=self.name,
            queued_items=load.queued_items,
            queued_tokens=load.queued_tokens,
            running_items=load.running_items,
            items_per_second=load.items_per_second,
            busy_fraction=load.busy_fraction,
            batch_items=load.batch_items,
        )


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = EncoderServicer(config, name)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
        servicer,
        epd_pb2_grpc.add_EncoderServicer_to_server,
    )
    server = servicer.role = RoleServer(name, config.encoder.listen, [service])
    options = config.heartbeat_options("encoder")
    heartbeat = Heartbeat(**options) if options else None
    return await run_worker(config.encoder, server, servicer.load, servicer.close, heartbeat)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
