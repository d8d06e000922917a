"""`epd up`: a whole cluster on one machine, each role a named child process.

    redis (embedded, unless a URL is given) -> encoder-0.. and lm-0.. -> proxy

Secrets (the API keys, the cluster secret that signs media hashes, the embedded Redis's
generated password) go to the children through their environment, never argv or the cluster
file. Each role is started with the same generated cluster file and its own --listen address; the
launcher waits until each reports SERVING over grpc.health.v1, prints the endpoints, and on
Ctrl-C / SIGTERM stops them in reverse order (proxy first, so nothing new arrives while the
workers drain). Children die with the launcher even if it is killed (see common.process).

Supervision: a role (or the embedded Redis) that dies after start-up is restarted on the same
address, after a backoff (0.5 s doubling, at most 8 s), while the cluster serves on the
survivors (the proxy fails its requests over). A role that dies more than `max_restarts` times
within RESTART_WINDOW seconds is given up on and the cluster stops, loudly. Restarts are
recorded in Redis ({namespace}:restarts) for the dashboard.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from common.config import ClusterConfig, dump_config, secret_env
from common.health import health_status
from common.process import Child, epd_command, free_port, port_is_free
from common.served_model import resolve_model
from connector import EmbeddedRedis, EmbeddedServerError, redact_url
from connector.embedded import EmbeddedCluster, default_maxmemory
from connector.registry import restarts_key
from models.demo import BUILTIN_DIR

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


RESTART_WINDOW = 300.0  # seconds over which a role's restarts count against its budget
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0


@dataclass
class Supervision:
    """One supervised process's restart record."""

    name: str
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the window
    restarts: int = 0
    due: float | None = None  # when the pending restart runs
    reason: str = ""

    def died(self, now: float, reason: str, budget: int) -> float | None:
        """The backoff before restarting, or None when the budget is spent."""
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW] + [now]
        self.reason = reason
        if len(self.deaths) > budget:
            return None
        return min(BACKOFF_FIRST * 2 ** (len(self.deaths) - 1), BACKOFF_MAX)


@dataclass
class Role:
    name: str  # "encoder-0"
    kind: str  # "encoder" | "lm" | "proxy": the `epd` subcommand
    address: str  # where its gRPC server listens
    env: dict[str, str] = field(default_factory=dict)  # its own settings (an LM worker's role)
    child: Child | None = None
    supervision: Supervision | None = None

    def __post_init__(self):
        self.supervision = Supervision(self.name)


class LocalCluster:
    def __init__(
        self,
        config: ClusterConfig,
        num_encoders: int = 1,
        num_lm_workers: int = 1,
        host: str = "127.0.0.1",
        startup_timeout: float = 600.0,
        max_restarts: int = 5,
        num_prefill_workers: int = 0,
        num_decode_workers: int = 0,
    ):
        if (num_prefill_workers > 0) != (num_decode_workers > 0):
            raise LaunchError(
                "the prefill / decode split needs both: --prefill-workers N --decode-workers M"
            )
        if num_encoders < 1 or num_lm_workers + num_prefill_workers < 1:
            raise LaunchError("a cluster needs at least one encoder and one LM worker")
        self.config = config
        self.host = host
        self.startup_timeout = startup_timeout
        self.redis: EmbeddedRedis | EmbeddedCluster | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix="epd-up-"))
        self.encoders = [
            Role(f"encoder-{i}", "encoder", f"127.0.0.1:{free_port()}") for i in range(num_encoders)
        ]
        self.lm_workers = [
            Role(f"lm-{i}", "lm", f"127.0.0.1:{free_port()}") for i in range(num_lm_workers)
        ]
        for role, n in (("prefill", num_prefill_workers), ("decode", num_decode_workers)):
            self.lm_workers += [
                Role(f"{role}-{i}", "lm", f"127.0.0.1:{free_port()}", {"EPD_LM_ROLE": role})
                for i in range(n)
            ]
        self.proxy = Role("proxy", "proxy", f"127.0.0.1:{config.proxy.grpc_port}")
        self.stopping = False
        self._wake = threading.Event()
        self.max_restarts = max_restarts
        self.redis_supervision = Supervision("redis")
        self.config_path: Path | None = None

    @property
    def roles(self) -> list[Role]:
        return [*self.encoders, *self.lm_workers, self.proxy]

    # ---------------------------------------------------------------------------- start

    def start(self) -> None:
        started = time.monotonic()
        self._check_ports_free()
        if self.config.model.path is None:
            # Resolved once here (the shipped checkpoint), so every role gets the same path.
            path = resolve_model(self.config).path
            model = dataclasses.replace(
                self.config.model, path=str(path), name=self.config.model.served_name
            )
            self.config = dataclasses.replace(self.config, model=model)
        connector = self.config.connector
        if connector.url is None:
            # Loopback only, bounded memory (LRU eviction: a miss re-encodes); a generated
            # password on a single server. In cluster mode: 3 embedded masters.
            password = None
            if connector.mode == "cluster":
                self.redis = EmbeddedCluster(masters=3)
            else:
                password = secrets.token_urlsafe(24)
                self.redis = EmbeddedRedis(maxmemory=default_maxmemory(), password=password)
            try:
                self.redis.start()
            except EmbeddedServerError as e:
                raise LaunchError(f"the embedded Redis server did not start: {e}") from e
            connector = dataclasses.replace(connector, url=self.redis.url, password=password)
        cluster = self.config.cluster
        if cluster.secret is None and cluster.secret_file is None:
            cluster = dataclasses.replace(cluster, secret=secrets.token_hex(32))
        self.config = dataclasses.replace(
            self.config,
            connector=connector,
            cluster=cluster,
            proxy=dataclasses.replace(
                self.config.proxy,
                host=self.host,
                encoders=tuple(r.address for r in self.encoders),
                lm_workers=tuple(r.address for r in self.lm_workers),
            ),
        )
        config_path = self.config_path = self.run_dir / "cluster.yaml"
        dump_config(self.config, config_path)

        workers = [*self.encoders, *self.lm_workers]
        for role in workers:
            self._spawn(role)
        self._wait_serving(workers)
        self._spawn(self.proxy)
        self._wait_serving([self.proxy])
        self._print_endpoints(time.monotonic() - started)

    def _check_ports_free(self) -> None:
        for key, port in (
            ("--grpc-port", self.config.proxy.grpc_port),
            ("--http-port", self.config.proxy.http_port),
        ):
            if not port_is_free(self.host, port):
                raise LaunchError(f"port {port} on {self.host} is in use: pass another {key}")

    def _spawn(self, role: Role) -> None:
        extra = [] if role.kind == "proxy" else ["--listen", role.address]
        argv = epd_command(
            role.kind, "--config", str(self.config_path), "--name", role.name, *extra
        )
        env = {**os.environ, **secret_env(self.config), **role.env}
        role.child = Child(role.name, argv, env=env)

    def _status(self, role: Role) -> str:
        """A role's health: grpc.health.v1 (over the cluster's mTLS for workers); the proxy's
        HTTPS /health when it serves clients over TLS (a loopback check of a child this
        launcher started: the certificate is not verified)."""
        if role.kind != "proxy":
            return health_status(role.address, timeout=0.5, tls=self.config.cluster.tls)
        if self.config.proxy.tls_cert is None:
            return health_status(role.address, timeout=0.5)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        url = f"https://127.0.0.1:{self.config.proxy.http_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=0.5, context=context) as reply:
                return "SERVING" if reply.status == 200 else "NOT_SERVING"
        except urllib.error.HTTPError:
            return "NOT_SERVING"
        except (urllib.error.URLError, OSError):
            return "UNREACHABLE"

    def _wait_serving(self, roles: list[Role]) -> None:
        """Until every role reports SERVING; LaunchError if one exits or time runs out."""
        deadline = time.monotonic() + self.startup_timeout
        last_report = time.monotonic()
        pending = {r.name: r for r in roles}
        status = {}
        while pending:
            if self.stopping:
                raise LaunchError("stopped during start-up")
            for name, role in list(pending.items()):
                if role.child.poll() is not None:
                    raise LaunchError(
                        f"{name} exited with code {role.child.poll()} during start-up "
                        "(its log is above)"
                    )
                status[name] = self._status(role)
                if status[name] == "SERVING":
                    del pending[name]
                    print(f"  {name} SERVING at {role.address}", file=sys.stderr, flush=True)
            now = time.monotonic()
            if pending and now > deadline:
                waiting = ", ".join(f"{n} ({status.get(n)})" for n in pending)
                raise LaunchError(f"not SERVING after {self.startup_timeout:.0f}s: {waiting}")
            if pending and now - last_report > 5:
                waiting = ", ".join(f"{n} ({status.get(n)})" for n in pending)
                print(f"  waiting for {waiting}", file=sys.stderr, flush=True)
                last_report = now
            if pending:
                self._wake.wait(0.1)  # start-up poll; a signal or a child's exit wakes it early

    def _print_endpoints(self, elapsed: float) -> None:
        c = self.config
        scheme = "https" if c.proxy.tls_cert else "http"
        http = f"{scheme}://{self.host}:{c.proxy.http_port}"
        redis_note = "embedded" if self.redis else "external"
        if c.connector.mode == "cluster":
            redis_note += ", cluster mode"
        lines = [
            f"epd cluster SERVING in {elapsed:.1f}s: model {c.model.served_name}",
            f"  gRPC       {self.proxy.address}  (epd.v1.Inference)",
            f"  HTTP       {http}  (OpenAI API under /v1; /dashboard, /health, /metrics)",
            *(f"  {r.name:<11}{r.address}" for r in self.encoders + self.lm_workers),
            f"  redis      {redact_url(c.connector.url)}  ({redis_note})",
            self._try_line(),
            "Ctrl-C stops the cluster.",
        ]
        print("\n".join(lines), flush=True)

    def _try_line(self) -> str:
        target = f"--target {self.proxy.address}"
        if Path(self.config.model.path).resolve() == BUILTIN_DIR.resolve():
            # The built-in model knows pictures of shapes only: text alone gets noise.
            return (
                f'try:       epd scene scene.png && epd generate "What is in this picture?" '
                f"--image scene.png {target}"
            )
        return f'try:       epd generate "Hello" {target}'

    # ---------------------------------------------------------------------------- run / stop

    def _on_signal(self, signum, frame) -> None:
        if signum in (signal.SIGINT, signal.SIGTERM):
            if self.stopping:
                print("second signal: killing every role now", file=sys.stderr, flush=True)
                for role in self.roles:
                    if role.child is not None:
                        role.child.signal(signal.SIGKILL)
                for child in self._redis_children():
                    child.signal(signal.SIGKILL)
            self.stopping = True
        self._wake.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)

    def wait(self) -> int:
        """Supervise until a signal (exit code 0) or a role out of restarts (exit code 1)."""
        while True:
            due = [
                s.due for s in self._supervisions() if s.due is not None
            ]  # the next restart wakes the loop
            timeout = max(min(due) - time.monotonic(), 0) if due else None
            self._wake.wait(timeout)
            self._wake.clear()
            if self.stopping:
                return 0
            now = time.monotonic()
            watched = [(r.supervision, r.child) for r in self.roles]
            if isinstance(self.redis, EmbeddedRedis):
                watched.insert(0, (self.redis_supervision, self.redis.child))
            elif any(child.poll() is not None for child in self._redis_children()):
                # A node of the embedded Redis Cluster: not restarted (its slots would need
                # re-assigning); the cluster stops, loudly.
                print(
                    "an embedded Redis Cluster node exited; stopping the cluster", file=sys.stderr
                )
                return 1
            for sup, child in watched:
                dead = sup.due is None and child is not None and child.poll() is not None
                if dead and not self._died(sup, child.poll(), now):
                    return 1
            if self.redis_supervision.due is not None and self.redis_supervision.due <= now:
                self._restart_redis()
            for role in self.roles:
                if role.supervision.due is not None and role.supervision.due <= now:
                    role.supervision.due = None
                    role.supervision.restarts += 1
                    self._spawn(role)
                    print(f"{role.name} restarted", file=sys.stderr, flush=True)
                    self._record(role.supervision)

    def _supervisions(self) -> list[Supervision]:
        return [self.redis_supervision, *(r.supervision for r in self.roles)]

    def _died(self, sup: Supervision, code: int, now: float) -> bool:
        """Schedule the restart; False when the budget is spent (the cluster stops)."""
        delay = sup.died(now, f"exit code {code}", self.max_restarts)
        if delay is None:
            print(
                f"{sup.name} stopped unexpectedly (exit code {code}) {len(sup.deaths)} times in "
                f"{RESTART_WINDOW:.0f}s, more than --max-restarts {self.max_restarts}; "
                "stopping the cluster",
                file=sys.stderr,
                flush=True,
            )
            return False
        sup.due = now + delay
        print(
            f"{sup.name} stopped unexpectedly (exit code {code}); restarting in {delay:.1f}s "
            f"(death {len(sup.deaths)} of {self.max_restarts} allowed in {RESTART_WINDOW:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _restart_redis(self) -> None:
        sup = self.redis_supervision
        sup.due = None
        self.redis.stop()  # its data is gone: the cluster re-encodes what it misses
        try:
            self.redis.start()
        except EmbeddedServerError as e:
            print(f"the embedded Redis did not restart: {e}", file=sys.stderr, flush=True)
            sup.due = time.monotonic() + BACKOFF_MAX
            return
        sup.restarts += 1
        print("the embedded Redis server restarted (empty)", file=sys.stderr, flush=True)
        for s in self._supervisions():  # the restart record was in it
            if s.restarts:
                self._record(s)

    def _record(self, sup: Supervision) -> None:
        """The restart in Redis, for the dashboard (best effort: Redis may be down too)."""
        c = self.config.connector
        value = {"restarts": sup.restarts, "last": round(time.time(), 1), "reason": sup.reason}
        try:
            with redis.Redis.from_url(c.redis_url, socket_timeout=2, socket_connect_timeout=2) as r:
                r.hset(restarts_key(c.namespace), sup.name, json.dumps(value))
        except (redis.RedisError, OSError) as e:
            logger.warning("could not record %s's restart in Redis: %s", sup.name, e)

    def _redis_children(self) -> list[Child]:
        servers = self.redis.nodes if self.redis is not None else []
        return [s.child for s in servers if s.child is not None]

    def stop(self) -> None:
        """Proxy first, then the workers (they drain in parallel), then Redis."""
        self.stopping = True
        c = self.config
        self._stop_group([self.proxy], c.proxy.drain_timeout_seconds + 10)
        drain = max(c.encoder.drain_timeout_seconds, c.lm.drain_timeout_seconds) + 10
        self._stop_group(self.encoders + self.lm_workers, drain)
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_group(self, roles: list[Role], timeout: float) -> None:
        live = [r for r in roles if r.child is not None]
        for role in live:
            role.child.signal(signal.SIGTERM)
        for role in live:
            code = role.child.stop(timeout)
            if code not in (0, -signal.SIGTERM, -signal.SIGKILL):
                print(f"{role.name} exited with code {code}", file=sys.stderr, flush=True)


def run_cluster(cluster: LocalCluster) -> int:
    cluster.install_signal_handlers()
    try:
        cluster.start()
        code = cluster.wait()
    except LaunchError as e:
        print(f"epd up: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print("stopping the cluster...", file=sys.stderr, flush=True)
        cluster.stop()
        print("cluster stopped", file=sys.stderr, flush=True)
    return code
