"""Child processes started while this process has gRPC calls in flight (as the launcher, the
benches and the test clusters do) must all start. A `preexec_fn` made most of them die between
fork and exec; this reproduces that load."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.process import Child, free_port, port_is_free


async def _spawn_while_busy(count: int) -> list[int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    busy = True

    async def ping() -> None:
        while busy:
            await stub.Check(health_pb2.HealthCheckRequest())

    pingers = [asyncio.create_task(ping()) for _ in range(4)]
    try:
        codes = []
        for i in range(count):
            child = await asyncio.to_thread(Child, f"true-{i}", ["true"])
            codes.append(await asyncio.to_thread(child.proc.wait))
        return codes
    finally:
        busy = False
        await asyncio.gather(*pingers)
        await channel.close()
        await server.stop(None)


def test_children_start_while_grpc_is_busy():
    codes = asyncio.run(_spawn_while_busy(40))
    assert codes == [0] * 40, f"exit codes: {codes}"


def test_a_child_goes_when_its_parent_is_killed():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from common.process import Child; "
            "print(Child('sleeper', ['sleep', '60']).pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # Reaped by init once it exits; a zombie still answers kill(0).
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):
                return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the child outlived its killed parent")


def test_free_ports_picked_one_after_another_differ():
    # None of them is bound in between: the OS alone sometimes picks one twice.
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:
        assert port_is_free("127.0.0.1", port)


def test_a_health_check_the_server_cancels_reads_unreachable():
    """A role that stops while it holds a health check cancels the call (grpc's CANCELLED, as
    the launcher's start-up poll met from a role exiting on a dead Redis): no answer, so the
    poll goes on to see the role's exit code, not an error that ends the launcher."""
    from concurrent import futures

    from common.health import UNREACHABLE, health_status

    class Stopping(health.HealthServicer):
        def Check(self, request, context):
            context.abort(grpc.StatusCode.CANCELLED, "the server is stopping")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(Stopping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert health_status(f"127.0.0.1:{port}", timeout=5) == UNREACHABLE
    finally:
        server.stop(None)
