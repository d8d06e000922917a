"""Fixtures: the embedded Redis-compatible server and real role servers on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from connector import EmbeddedRedis
from epd.process import Child, epd_command, free_port
from tests.helpers import RoleProcess


@pytest.fixture
def redis_server():
    """A private valkey-server on a free loopback port, stopped (and its directory removed)
    after the test."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def start_role(tmp_path):
    """start_role(kind, config_path) -> RoleProcess: `epd <kind>` as a real child process on a
    free loopback port. It is not waited for; call .wait_status("SERVING")."""
    started: list[RoleProcess] = []

    def start(kind: str, config_path: Path, name: str | None = None) -> RoleProcess:
        name = name or kind
        if kind == "proxy":
            cfg = yaml.safe_load(config_path.read_text())
            address = f"127.0.0.1:{cfg['proxy']['grpc_port']}"
            extra = []
        else:
            address = f"127.0.0.1:{free_port()}"
            extra = ["--listen", address]
        argv = epd_command(kind, "--config", str(config_path), "--name", name, *extra)
        role = RoleProcess(name, kind, address, Child(name, argv))
        started.append(role)
        return role

    yield start
    for role in started:
        role.child.stop(10)
