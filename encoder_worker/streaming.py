"""Encoder.EncodeStream: one realtime session's audio in, its embeddings published in order.

The call is the session's encoder state: the family's stream (`open_stream`: conv padding
cache, encoder KV cache) lives as long as the call. Each audio chunk runs through it (in a
worker thread, off the event loop) and the embeddings it completes are appended to the
session's Redis Stream (connector/streams.py) before the call answers with the count so far;
`input_done` flushes the rest and writes the stream's last entry. A call that ends without
`input_done` (the proxy went away, or moves the session to another encoder) leaves the stream
as it is: a replay appends the same rows again and the reader keeps each once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from connector.streams import SessionStreams, StreamError
from encoder_worker.metrics import EncoderMetrics
from models import MediaError
from proto import epd_pb2

logger = logging.getLogger(__name__)

SAMPLE_FORMATS = {
    epd_pb2.AUDIO_FORMAT_PCM_S16LE: (np.dtype("<i2"), 1.0 / 32768.0),
    epd_pb2.AUDIO_FORMAT_PCM_F32LE: (np.dtype("<f4"), 1.0),
}


class BadStream(ValueError):
    """What the caller got wrong (INVALID_ARGUMENT)."""


def pcm_samples(data: bytes, audio_format: int) -> np.ndarray:
    """Headerless mono PCM -> float32 samples in [-1, 1)."""
    dtype, scale = SAMPLE_FORMATS[audio_format]
    if len(data) % dtype.itemsize:
        raise BadStream(
            f"an audio chunk of {len(data)} bytes is not a whole number of "
            f"{dtype.itemsize}-byte samples"
        )
    samples = np.frombuffer(data, dtype=dtype).astype(np.float32)
    if scale != 1.0:
        samples *= scale
    if not np.all(np.isfinite(samples)):
        raise BadStream("the audio holds NaN or infinite samples")
    return samples


class StreamEncoder:
    """The EncodeStream calls of one worker: at most `max_streams` at once."""

    def __init__(
        self,
        encoder,  # the family's MediaEncoder, with open_stream()
        sample_rate: int,
        streams: SessionStreams,
        metrics: EncoderMetrics,
        max_streams: int,
        unsupported: str = "",  # why the model takes no realtime audio (empty: it does)
    ):
        self.encoder = encoder
        self.unsupported = unsupported
        self.sample_rate = sample_rate
        self.streams = streams
        self.metrics = metrics
        self.max_streams = max_streams
        self.active = 0

    async def serve(
        self, requests: AsyncIterator[epd_pb2.EncodeStreamRequest], context
    ) -> AsyncIterator[epd_pb2.EncodeStreamResponse]:
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("event") != "start":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first EncodeStream message must be `start`"
            )
        start = first.start
        if self.unsupported:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.unsupported)
        try:
            self.streams.key(start.session_id)
            if start.format not in SAMPLE_FORMATS:
                raise BadStream("EncodeStream takes PCM_S16LE or PCM_F32LE audio")
            if start.sample_rate != self.sample_rate:
                raise BadStream(
                    f"the session's audio is at {start.sample_rate} Hz; this model takes "
                    f"{self.sample_rate} Hz"
                )
            if not hasattr(self.encoder, "open_stream"):
                raise BadStream("this model's encoder does not stream (no realtime sessions)")
            stream = self.encoder.open_stream()
        except (BadStream, ValueError, MediaError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.active >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this encoder runs {self.active} realtime sessions (encoder.max_streams)",
            )
        self.active += 1
        self.metrics.streams_open.set(self.active)
        session = start.session_id
        published = 0
        try:
            # Accepted: the client holds its audio back until this answer. A refusal above
            # thus reaches it before it writes again (gRPC Python reports a server's status
            # that races a client write as INTERNAL, hiding RESOURCE_EXHAUSTED).
            yield epd_pb2.EncodeStreamResponse(num_published=0, audio_seconds=0.0)
            async for msg in requests:
                kind = msg.WhichOneof("event")
                if kind == "audio":
                    try:
                        samples = pcm_samples(msg.audio, start.format)
                    except BadStream as e:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    started = time.perf_counter()
                    rows = await asyncio.to_thread(stream.push, samples)
                    self.metrics.stream_chunk_seconds.observe(time.perf_counter() - started)
                    self.metrics.stream_audio_seconds.inc(samples.shape[0] / self.sample_rate)
                    published = await self._publish(session, published, rows, context)
                    yield epd_pb2.EncodeStreamResponse(
                        num_published=published, audio_seconds=stream.audio_seconds
                    )
                elif kind == "input_done":
                    rows = await asyncio.to_thread(stream.finish)
                    try:  # the last rows and the end in one entry
                        await self.streams.finish(session, published, rows)
                    except StreamError as e:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                    self.metrics.stream_embeddings.inc(rows.shape[0])
                    published += rows.shape[0]
                    yield epd_pb2.EncodeStreamResponse(
                        num_published=published, audio_seconds=stream.audio_seconds, done=True
                    )
                    return
                else:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "`start` comes once, first"
                    )
        finally:
            self.active -= 1
            self.metrics.streams_open.set(self.active)

    async def _publish(self, session: str, published: int, rows, context) -> int:
        if rows.shape[0] == 0:
            return published
        try:
            await self.streams.append(session, published, rows)
        except StreamError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.stream_embeddings.inc(rows.shape[0])
        return published + rows.shape[0]


__all__ = ["BadStream", "StreamEncoder", "pcm_samples"]
