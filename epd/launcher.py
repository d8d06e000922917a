"""`epd up`: a whole cluster on one machine, each role a named child process.

    redis (embedded, unless a URL is given) -> encoder-0.. and lm-0.. -> proxy

Secrets (the API keys, the cluster secret that signs media hashes, the embedded Redis's
generated password) go to the children through their environment, never argv or the cluster
file. Each role is started with the same generated cluster file and its own --listen address; the
launcher waits until each reports SERVING over grpc.health.v1, prints the endpoints, and on
Ctrl-C / SIGTERM stops them in reverse order (proxy first, so nothing new arrives while the
workers drain). Children die with the launcher even if it is killed (see common.process).

Encoders that scale themselves (`--encoders auto[:MIN:MAX]`): the proxy's encoder planner
(proxy/planner.py) writes the encoder count demand needs to Redis; once a second the launcher
reads it and starts encoders (encoder-N, found by the proxy through the registry) or drains the
newest: SIGTERM, the encoder leaves the registry, finishes what it holds and exits, and is
forgotten (not restarted). No request fails meanwhile: a call it refuses while draining is
retried on another encoder.

Supervision: a role (or the embedded Redis) that dies after start-up is restarted on the same
address, after a backoff (0.5 s doubling, at most 8 s), while the cluster serves on the
survivors (the proxy fails its requests over). A role that dies more than `max_restarts` times
within RESTART_WINDOW seconds is backed off: still restarted, but 16 s after its next death,
then 32 s, ... at most BACKOFF_LONG, until it has served RESTART_WINDOW unbroken; the other
roles serve on. The cluster stops (exit code 1) only when a kind of role cannot run at all:
every encoder, every LM worker or the proxy has had more than `max_restarts` restarts in a row
die before reaching SERVING (a model that no longer loads, say). A hostile client that kills a
role again and again therefore costs that role, never the cluster. Each death, restart and
return to SERVING is logged and recorded in Redis ({namespace}:restarts) for the dashboard.
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

from common.config import ClusterConfig, ConfigError, dump_config, secret_env
from common.health import health_status
from common.process import Child, epd_command, free_port, port_is_free
from common.served_model import resolve_model
from connector import EmbeddedRedis, EmbeddedServerError, redact_url
from connector.client import sync_client
from connector.embedded import EmbeddedCluster, default_maxmemory
from connector.registry import restarts_key
from models.demo import BUILTIN_DIR
from proxy.planner import fresh_desired, planner_key

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


RESTART_WINDOW = 300.0  # seconds over which a role's deaths count against its budget
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0  # within the budget: 0.5 s doubling to 8 s
BACKOFF_LONG = 300.0  # past it (backed off): 16 s doubling to this
HEALTH_POLL = 0.5  # seconds between health checks of a restarted role until it is SERVING
KINDS = ("encoder", "lm", "proxy")  # the cluster needs one of each that can run
PLAN_POLL = 1.0  # seconds between reads of the planner's answer (--encoders auto)
PLAN_MAX_AGE = 10.0  # a proxy's answer older than this is not acted on


@dataclass
class Supervision:
    """One supervised process's deaths, backoff and restart record."""

    name: str
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the window
    restarts: int = 0
    started: float | None = None  # monotonic time of its last (re)start
    serving: bool = False  # reached SERVING since that start
    unserved: int = 0  # deaths in a row before reaching SERVING: restarts that could not run
    backoffs: int = 0  # deaths past the budget since it last served a window unbroken
    due: float | None = None  # when the pending restart runs
    code: int | None = None  # its last exit code

    @property
    def reason(self) -> str:
        return "" if self.code is None else f"exit code {self.code}"

    def died(self, now: float, code: int, budget: int) -> float:
        """Schedule the restart; its delay in seconds. 0.5 s doubling to 8 s while its deaths
        within RESTART_WINDOW are at most `budget`; past that it is backed off, 16 s doubling to
        BACKOFF_LONG, until it has served RESTART_WINDOW unbroken."""
        self.settle(now)
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW] + [now]
        if not self.serving:
            self.unserved += 1
        self.serving = False
        self.code = code
        if self.backoffs or len(self.deaths) > budget:
            self.backoffs += 1
            delay = min(BACKOFF_MAX * 2**self.backoffs, BACKOFF_LONG)
        else:
            delay = min(BACKOFF_FIRST * 2 ** (len(self.deaths) - 1), BACKOFF_MAX)
        self.due = now + delay
        return delay

    def restarted(self, now: float) -> None:
        self.due, self.started, self.serving = None, now, False
        self.restarts += 1

    def reached_serving(self) -> None:
        self.serving, self.unserved = True, 0

    def settle(self, now: float) -> bool:
        """End the backoff of one that has served RESTART_WINDOW unbroken; True if it ended."""
        settled = self.serving and self.started is not None and now - self.started >= RESTART_WINDOW
        if self.backoffs and settled:
            self.backoffs = 0
            return True
        return False

    def cannot_run(self, budget: int) -> bool:
        """More than `budget` restarts in a row died before reaching SERVING."""
        return self.unserved > budget

    def record(self, now: float, budget: int) -> dict:
        """Its entry in {namespace}:restarts, for the dashboard (times: unix seconds)."""
        wall = time.time()
        state = "waiting" if self.due is not None else "serving" if self.serving else "starting"
        return {
            "restarts": self.restarts,
            "last": round(wall, 1),
            "reason": self.reason,
            "exit_code": self.code,
            "deaths": sum(now - t < RESTART_WINDOW for t in self.deaths),
            "window_seconds": RESTART_WINDOW,
            "backed_off": self.backoffs > 0,
            "state": state,  # "waiting" for its restart, "starting", "serving"
            "until": None if self.due is None else round(wall + self.due - now, 1),
            "cannot_run": self.cannot_run(budget),
        }


@dataclass
class Role:
    name: str  # "encoder-0"
    kind: str  # "encoder" | "lm" | "proxy": the `epd` subcommand
    address: str  # where its gRPC server listens
    env: dict[str, str] = field(default_factory=dict)  # its own settings (an LM worker's role)
    child: Child | None = None
    supervision: Supervision | None = None
    retiring: bool = False  # drained by the planner: its exit is its end, not a death

    def __post_init__(self):
        self.supervision = Supervision(self.name)


def parse_encoders(value: str, config: ClusterConfig) -> tuple[int, tuple[int, int] | None]:
    """`--encoders`: a count, or `auto[:MIN:MAX]` (the bounds default to proxy.encoders_min /
    encoders_max). (count to start with, (min, max) or None)."""
    head, *bounds = value.split(":")
    try:
        if head != "auto":
            if bounds:
                raise ValueError
            return int(head), None
        if len(bounds) not in (0, 2):
            raise ValueError
        low, high = (
            map(int, bounds) if bounds else (config.proxy.encoders_min, config.proxy.encoders_max)
        )
    except ValueError:
        raise ConfigError(
            "--encoders", f"must be a count or auto[:MIN:MAX] (auto:1:4), got {value!r}"
        ) from None
    if not 1 <= low <= high:
        raise ConfigError("--encoders", f"auto:{low}:{high} needs 1 <= MIN <= MAX")
    return low, (low, high)


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
        encoders_auto: tuple[int, int] | None = None,
    ):
        if (num_prefill_workers > 0) != (num_decode_workers > 0):
            raise LaunchError(
                "the prefill / decode split needs both: --prefill-workers N --decode-workers M"
            )
        if num_encoders < 1 or num_lm_workers + num_prefill_workers < 1:
            raise LaunchError("a cluster needs at least one encoder and one LM worker")
        self.auto = encoders_auto  # (min, max): the planner sizes the encoders
        if encoders_auto is not None:
            low, high = encoders_auto
            if not config.registry.enabled:
                raise LaunchError(
                    "--encoders auto needs registry.enabled: the proxy finds the encoders it "
                    "starts through the registry"
                )
            proxy = dataclasses.replace(config.proxy, encoders_min=low, encoders_max=high)
            config = dataclasses.replace(config, proxy=proxy)  # checks 1 <= low <= high
            num_encoders = low
        self.config = config
        self.host = host
        self.startup_timeout = startup_timeout
        self.redis: EmbeddedRedis | EmbeddedCluster | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix="epd-up-"))
        self.encoders = [self._encoder_role(i) for i in range(num_encoders)]
        self._next_encoder = num_encoders
        self._last_plan = 0.0
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None  # _store()
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

    @staticmethod
    def _encoder_role(i: int) -> Role:
        return Role(f"encoder-{i}", "encoder", f"127.0.0.1:{free_port()}")

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
                # Autoscaled encoders come and go through the registry; static ones never leave.
                encoders=() if self.auto else tuple(r.address for r in self.encoders),
                lm_workers=tuple(r.address for r in self.lm_workers),
            ),
        )
        tp, one_gpu = self.config.lm.tensor_parallel_size, _share_one_gpu(self.config)
        if tp > 1 and len(self.lm_workers) > 1 and one_gpu:
            raise LaunchError(
                f"lm.tensor_parallel_size {tp}: each LM worker takes GPUs 0 .. {tp - 1}, so "
                f"{len(self.lm_workers)} of them would share them; start one LM worker per "
                "machine (or set lm.device: cpu)"
            )
        if one_gpu:
            encoders = len(self.encoders) if self.auto is None else self.auto[1]
            self.config = split_gpu_memory(self.config, encoders, len(self.lm_workers))
        config_path = self.config_path = self.run_dir / "cluster.yaml"
        dump_config(self.config, config_path)

        workers = [*self.encoders, *self.lm_workers]
        for role in workers:
            self._spawn(role)
        self._wait_serving(workers)
        self._spawn(self.proxy)
        self._wait_serving([self.proxy])
        for sup in self._supervisions():
            sup.started = time.monotonic()
            sup.reached_serving()
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
            *(
                [f"  encoders   {self.auto[0]}..{self.auto[1]}, as the planner asks"]
                if self.auto
                else []
            ),
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
        """Supervise until a signal (exit code 0) or a kind of role that cannot run at all
        (exit code 1)."""
        while True:
            self._wake.wait(self._next_wake(time.monotonic()))
            self._wake.clear()
            if self.stopping:
                return 0
            code = self.supervise(time.monotonic())
            if code is not None:
                return code

    def _next_wake(self, now: float) -> float | None:
        """Seconds until the next restart, health check of a restarted role, or end of a
        backoff; None: only a signal or a child's exit (SIGCHLD) wakes the loop."""
        times = [s.due for s in self._supervisions() if s.due is not None]
        if any(self._starting(r) for r in self.roles):
            times.append(now + HEALTH_POLL)
        if self.auto:
            times.append(self._last_plan + PLAN_POLL)
        times += [
            s.started + RESTART_WINDOW
            for s in self._supervisions()
            if s.backoffs and s.serving and s.started is not None
        ]
        return max(min(times) - now, 0) if times else None

    def supervise(self, now: float) -> int | None:
        """One pass: schedule the restart of what died, run the restarts that are due, check
        the restarted roles' health, and with --encoders auto size the encoders to the planner's
        answer (once a second). An exit code when the cluster must stop."""
        nodes = [] if isinstance(self.redis, EmbeddedRedis) else self._redis_children()
        if any(child.poll() is not None for child in nodes):
            # A node of the embedded Redis Cluster: not restarted (its slots would need
            # re-assigning); the cluster stops, loudly.
            print("an embedded Redis Cluster node exited; stopping the cluster", file=sys.stderr)
            return 1
        for role in [r for r in self.encoders if r.retiring and r.child.poll() is not None]:
            self.encoders.remove(role)
            print(
                f"{role.name} drained and stopped (exit code {role.child.poll()})",
                file=sys.stderr,
                flush=True,
            )
        watched = [(r.supervision, r.child) for r in self.roles if not r.retiring]
        if isinstance(self.redis, EmbeddedRedis):
            watched.insert(0, (self.redis_supervision, self.redis.child))
        for sup, child in watched:
            if sup.due is None and child is not None and child.poll() is not None:
                self._died(sup, child.poll(), now)
        if (kind := self._kind_that_cannot_run()) is not None:
            roles = [r for r in self.roles if r.kind == kind]
            print(
                f"no {kind} can run: {', '.join(r.name for r in roles)} each died more than "
                f"--max-restarts {self.max_restarts} times in a row before reaching SERVING "
                f"(last: {roles[-1].supervision.reason}); stopping the cluster",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if self.redis_supervision.due is not None and self.redis_supervision.due <= now:
            self._restart_redis(now)
        for role in self.roles:
            sup = role.supervision
            if sup.due is not None and sup.due <= now:
                sup.restarted(now)
                self._spawn(role)
                print(f"{role.name} restarted", file=sys.stderr, flush=True)
                self._record(sup, now)
            elif self._starting(role) and self._status(role) == "SERVING":
                sup.reached_serving()
                again = " again" if sup.restarts else ""
                print(f"{role.name} SERVING{again} at {role.address}", file=sys.stderr, flush=True)
                if sup.restarts:
                    self._record(sup, now)
        if self.auto and now - self._last_plan >= PLAN_POLL:
            self._last_plan = now
            self._scale(now)
        for sup in self._supervisions():
            if sup.settle(now):
                print(
                    f"{sup.name} has served {RESTART_WINDOW:.0f}s unbroken: no longer backed off",
                    file=sys.stderr,
                    flush=True,
                )
                self._record(sup, now)
        return None

    def _scale(self, now: float) -> None:
        """Start or drain encoders toward the planner's answer (the largest of the proxies'
        fresh answers in Redis; none fresh: nothing changes)."""
        try:
            entries = self._store().hgetall(planner_key(self.config.connector.namespace))
        except (redis.RedisError, OSError) as e:
            logger.warning("could not read the planner's answer: %s", e)
            return
        desired = fresh_desired(entries, time.time(), PLAN_MAX_AGE)
        if desired is None:
            return
        low, high = self.auto
        desired = min(max(desired, low), high)
        active = [r for r in self.encoders if not r.retiring]
        for _ in range(desired - len(active)):
            role = self._encoder_role(self._next_encoder)
            self._next_encoder += 1
            self.encoders.append(role)
            role.supervision.started = now
            self._spawn(role)
            print(
                f"{role.name} starting: the planner wants {desired} encoders",
                file=sys.stderr,
                flush=True,
            )
        for role in active[desired:][::-1]:  # the newest first
            role.retiring = True
            role.child.signal(signal.SIGTERM)
            print(
                f"{role.name} draining: the planner wants {desired} encoders",
                file=sys.stderr,
                flush=True,
            )

    def _starting(self, role: Role) -> bool:
        """Restarted, alive, not yet SERVING: its health is polled."""
        sup = role.supervision
        alive = role.child is not None and role.child.poll() is None
        return sup.due is None and not sup.serving and alive

    def _kind_that_cannot_run(self) -> str | None:
        """A kind every replica of which has had more than `max_restarts` restarts in a row
        die before reaching SERVING."""
        for kind in KINDS:
            roles = [r for r in self.roles if r.kind == kind and not r.retiring]
            if roles and all(r.supervision.cannot_run(self.max_restarts) for r in roles):
                return kind
        return None

    def _supervisions(self) -> list[Supervision]:
        return [self.redis_supervision, *(r.supervision for r in self.roles)]

    def _died(self, sup: Supervision, code: int, now: float) -> None:
        """Schedule the restart, and say when and why."""
        delay = sup.died(now, code, self.max_restarts)
        deaths = f"{len(sup.deaths)} deaths in {RESTART_WINDOW:.0f}s"
        if sup.backoffs:
            plan = (
                f"backed off: restarting in {delay:.0f}s ({deaths}; past --max-restarts "
                f"{self.max_restarts} a role is retried less and less often until it serves "
                f"{RESTART_WINDOW:.0f}s unbroken; the other roles keep serving)"
            )
        else:
            plan = (
                f"restarting in {delay:.1f}s (death {len(sup.deaths)} of {self.max_restarts} "
                f"allowed in {RESTART_WINDOW:.0f}s)"
            )
        print(
            f"{sup.name} stopped unexpectedly (exit code {code}); {plan}",
            file=sys.stderr,
            flush=True,
        )
        if sup.cannot_run(self.max_restarts):
            print(
                f"{sup.name} cannot run here: {sup.unserved} restarts in a row died before "
                "SERVING; still retried, and the cluster stops if no other of its kind can run",
                file=sys.stderr,
                flush=True,
            )
        self._record(sup, now)

    def _restart_redis(self, now: float) -> None:
        sup = self.redis_supervision
        sup.due = None
        self.redis.stop()  # its data is gone: the cluster re-encodes what it misses
        try:
            self.redis.start()
        except EmbeddedServerError as e:
            print(f"the embedded Redis did not restart: {e}", file=sys.stderr, flush=True)
            sup.due = time.monotonic() + BACKOFF_MAX
            return
        sup.restarted(now)
        sup.reached_serving()
        print("the embedded Redis server restarted (empty)", file=sys.stderr, flush=True)
        for s in self._supervisions():  # the restart record was in it
            if s.code is not None:  # it has died before: it has a record
                self._record(s, now)

    def _record(self, sup: Supervision, now: float) -> None:
        """Its restart record in Redis, for the dashboard."""
        self._write_record(sup.name, sup.record(now, self.max_restarts))

    def _write_record(self, name: str, value: dict) -> None:
        """Best effort: Redis may be down too."""
        key = restarts_key(self.config.connector.namespace)
        try:
            self._store().hset(key, name, json.dumps(value))
        except (redis.RedisError, OSError) as e:
            logger.warning("could not record %s's restart in Redis: %s", name, e)

    def _store(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The launcher's own Redis client (restart records, the planner's answer), made on
        first use, once the connector's URL is known: 2 s a command and one retry, so a Redis
        that is down costs the supervision loop seconds, not minutes; it reconnects by itself
        after the embedded server restarts."""
        if self._client is None:
            c = self.config.connector
            self._client = sync_client(c.redis_url, op_timeout=2.0, retries=1, mode=c.mode)
        return self._client

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
        if self._client is not None:
            self._client.close()
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


def _share_one_gpu(config: ClusterConfig) -> bool:
    """Whether the encoders and LM workers this launcher starts land on the same GPU (each
    role's `cuda` is the first visible device)."""
    if "cpu" in (config.encoder.device, config.lm.device):
        return False
    import torch  # (loaded already: resolve_model's families import it)

    return torch.cuda.is_available()


def split_gpu_memory(config: ClusterConfig, encoders: int, lm_workers: int) -> ClusterConfig:
    """One GPU for every role: each encoder holds encoder.gpu_memory_utilization of it, and the
    LM workers share what lm.gpu_memory_utilization leaves, equally; each LM worker's
    lm.gpu_memory_reserved is the rest (lm_worker/memory_plan.py), so the split follows the
    configuration, not the order the roles start in."""
    lm = config.lm
    held = lm.gpu_memory_reserved + encoders * config.encoder.gpu_memory_utilization
    each = (lm.gpu_memory_utilization - held) / lm_workers
    if each <= 0.01:
        raise LaunchError(
            f"one GPU for {encoders} encoder(s) at encoder.gpu_memory_utilization "
            f"{config.encoder.gpu_memory_utilization} and {lm_workers} LM worker(s) leaves "
            f"them {each:.3f} of it each, within lm.gpu_memory_utilization "
            f"{lm.gpu_memory_utilization}: lower the encoders' share or start fewer roles"
        )
    reserved = round(lm.gpu_memory_utilization - each, 6)
    logger.info(
        "one GPU: %d encoder(s) hold %s of it each, %d LM worker(s) %.3f each",
        encoders,
        config.encoder.gpu_memory_utilization,
        lm_workers,
        each,
    )
    return dataclasses.replace(config, lm=dataclasses.replace(lm, gpu_memory_reserved=reserved))
