"""Helpers the test files share (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import yaml

from common.cluster_auth import token_for
from common.health import health_status
from common.process import Child
from common.signing import HashSigner
from common.tls import cluster_channel

# The cluster secret of every role a test starts (conftest puts it in the environment).
TEST_CLUSTER_SECRET = "epd-test-cluster-secret-0123456789"

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.02
) -> T:
    """Until `condition()` is true (polled every `every` s); its value. Fails naming `what` at
    the deadline: a wait on the event a test means, never a fixed sleep standing in for it."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)
    return value


async def wait_until_async(
    condition: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.02
) -> T:
    """wait_until inside an event loop: sleeps with asyncio, so the loop's tasks run."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(every)
    return value


def worker_channel(address: str, options: list = ()) -> grpc.Channel:
    """A blocking channel straight to a worker a test started, carrying the cluster token the
    proxy sends (common/cluster_auth.py): without it a worker answers only health checks."""
    return cluster_channel(address, None, options, token=token_for(TEST_CLUSTER_SECRET.encode()))


def sign(mm_hash: str) -> bytes:
    """The tag the proxy would attach to `mm_hash` in the test cluster."""
    return HashSigner(TEST_CLUSTER_SECRET.encode()).sign(mm_hash)


@dataclass
class RoleProcess:
    name: str
    kind: str
    address: str
    child: Child

    def wait_status(self, want: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            assert self.child.poll() is None, f"{self.name} exited with {self.child.poll()}"
            status = health_status(self.address, timeout=0.5)
            if status == want:
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.name} at {self.address}: {status}, wanted {want}")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code."""
        return self.child.stop(timeout)


def write_config(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path
