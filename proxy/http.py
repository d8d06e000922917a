"""The proxy's HTTP API (aiohttp): OpenAI-compatible routes, /health and /metrics."""

from __future__ import annotations

import logging
import time

import prometheus_client
from aiohttp import web

from proto import epd_pb2

logger = logging.getLogger(__name__)


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error in the OpenAI API's shape, which its client libraries parse."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status,
    )


class HttpApi:
    def __init__(self, card: epd_pb2.ModelCard):
        self.card = card
        self.created = int(time.time())
        self.serving = False
        self.app = web.Application()
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.models),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise OSError(f"proxy cannot listen for HTTP on {host}:{port}: {e.strerror}") from e
        logger.info("HTTP API on %s:%d", host, port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        status = "serving" if self.serving else "not serving"
        return web.json_response({"status": status}, status=200 if self.serving else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = prometheus_client.generate_latest()
        return web.Response(
            body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.card.id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "epd",
                    }
                ],
            }
        )

    async def chat_completions(self, request: web.Request) -> web.Response:
        return openai_error(
            501,
            "chat completions are not implemented in this build (they land with issue 7)",
            "not_implemented",
        )
