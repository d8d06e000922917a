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

from common import tracing
from common.cluster_auth import required_token
from common.config import ClusterConfig
from common.media import media_from_proto
from common.server import RoleServer, Service, run_worker
from common.signing import HashSigner
from common.tls import cluster_server_credentials
from connector import AsyncECConnector, wait_until_reachable
from connector.registry import Heartbeat
from connector.streams import SessionStreams
from encoder_worker.encoder import EncodeItem, ItemResult, MMEncoder
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.streaming import StreamEncoder
from encoder_worker.tower import Tower, load_tower
from models import MediaError
from proto import epd_pb2, epd_pb2_grpc

logger = logging.getLogger(__name__)

STATUS_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
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


def to_items(request: epd_pb2.EncodeRequest, signer: HashSigner) -> list[EncodeItem | ItemResult]:
    """Each proto item as an EncodeItem, or as its failed result when it cannot be read or its
    hash does not carry the proxy's signature (nothing is stored under an unsigned hash)."""
    out: list[EncodeItem | ItemResult] = []
    for item in request.items:
        if not signer.verify(item.mm_hash, item.mm_hash_tag):
            out.append(
                ItemResult.failed(
                    item.mm_hash,
                    "permission_denied",
                    "mm_hash_tag does not match: only the proxy assigns hashes (cluster.secret "
                    "must be the same on the proxy and every encoder)",
                    0.0,
                )
            )
            continue
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
        self.signer = HashSigner(config.cluster.signing_key())
        self.role: RoleServer | None = None
        self.tower: Tower | None = None
        self.connector: AsyncECConnector | None = None
        self.encoder: MMEncoder | None = None
        self.streams: SessionStreams | None = None
        self.stream_encoder: StreamEncoder | None = None

    async def load(self) -> None:
        """Redis reachable, the tower loaded and warm, the batch loop running."""
        c = self.config
        await wait_until_reachable(
            c.connector.redis_url, c.connector.startup_wait_seconds, c.connector.mode
        )
        self.tower, served = await asyncio.to_thread(load_tower, c)
        self.connector = AsyncECConnector(
            fingerprint=served.fingerprint,
            registry=self.registry,
            **c.connector.store_options(),
        )
        metrics = EncoderMetrics(self.registry)
        encoder = MMEncoder(self.tower, self.connector, c.encoder, metrics)
        encoder.start()
        self.encoder = encoder
        options = c.connector.connector_options()
        options.pop("local_tier_bytes")
        self.streams = SessionStreams(**options)
        try:
            rate, unsupported = served.family.realtime_sample_rate, ""
        except MediaError as e:
            rate, unsupported = 0, str(e)  # EncodeStream says so
        self.stream_encoder = StreamEncoder(
            self.tower.encoder, rate, self.streams, metrics, c.encoder.max_streams, unsupported
        )
        logger.info("encoding %s (fingerprint %s)", served.name, served.fingerprint)

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.close()
        if self.connector is not None:
            await self.connector.close()
        if self.streams is not None:
            await self.streams.close()

    async def Encode(
        self, request: epd_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> epd_pb2.EncodeResponse:
        async with self.role.work(context):
            if self.encoder is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is still loading")
            tracer = tracing.tracer()
            span = tracing.server_span(
                "encoder.encode", context, encoder=self.name, items=len(request.items)
            )
            converted = to_items(request, self.signer)
            for c in converted:
                if isinstance(c, ItemResult):
                    self.encoder.metrics.error[c.error_kind].inc()
            refused = sum(isinstance(c, ItemResult) and c.error_kind == "permission_denied"
                          for c in converted)  # fmt: skip
            if refused:
                logger.warning(
                    "request %s: refused %d items with an unsigned or forged mm_hash",
                    request.request_id,
                    refused,
                )
            items = [c for c in converted if isinstance(c, EncodeItem)]
            encoded = iter(await self.encoder.execute_mm_encoder(items))
            results = [c if isinstance(c, ItemResult) else next(encoded) for c in converted]
            outcomes = [r.outcome for r in results]
            tracer.end(
                span,
                [stage for r in results for stage in r.stages],
                stored=outcomes.count("stored"),
                held=outcomes.count("held"),
                failed=outcomes.count("failed"),
            )
            logger.debug(
                "request %s: %s", request.request_id, ", ".join(r.outcome for r in results)
            )
            dtype = self.tower.dtype
            return epd_pb2.EncodeResponse(results=[to_result(r, dtype) for r in results])

    async def EncodeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """One realtime session's audio in, its embeddings out to its stream, in order
        (encoder_worker/streaming.py)."""
        async with self.role.work(context):
            if self.stream_encoder is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is still loading")
            span = tracing.server_span("encoder.encode_stream", context, encoder=self.name)
            responses = 0
            try:
                async for response in self.stream_encoder.serve(request_iterator, context):
                    responses += 1
                    yield response
            finally:
                tracing.tracer().end(span, responses=responses)

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
            active_streams=self.stream_encoder.active,
        )


async def serve(config: ClusterConfig, name: str) -> int:
    servicer = EncoderServicer(config, name)
    service = Service(
        epd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
        servicer,
        epd_pb2_grpc.add_EncoderServicer_to_server,
    )
    credentials = cluster_server_credentials(config.cluster.tls)
    token = required_token(config.cluster)  # only the proxy may call (cluster_auth)
    server = servicer.role = RoleServer(name, config.encoder.listen, [service], credentials, token)
    options = config.heartbeat_options("encoder")
    heartbeat = Heartbeat(**options) if options else None
    return await run_worker(config.encoder, server, servicer.load, servicer.close, heartbeat)


def main(config: ClusterConfig, name: str) -> int:
    return asyncio.run(serve(config, name))
