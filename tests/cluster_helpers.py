"""A whole cluster of real processes for end-to-end tests: an embedded Redis, encoders, LM
workers and the proxy, each started on its own so a test can kill or add one."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml
from PIL import Image

from common.process import Child, epd_command, free_port
from connector import EmbeddedRedis
from proto import epd_pb2, epd_pb2_grpc
from tests.helpers import RoleProcess


def wait_proxy_sees_workers_serving(
    health: Callable[[], tuple[int, dict]], timeout: float = 30.0
) -> None:
    """Until the proxy's own view (`health()`: /health's status and body) has every worker
    SERVING: a worker the proxy probed before it listened is UNREACHABLE there until the
    channel reconnects, though its own health already says SERVING."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = health()
        workers = [w for r in body.get("roles", {}).values() for w in r["workers"]]
        if status == 200 and workers and all(w["status"] == "SERVING" for w in workers):
            return
        assert time.monotonic() < deadline, f"the proxy does not see its workers: {body}"
        time.sleep(0.1)


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A distinct image per seed (a gradient, so the tower's rows differ)."""
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x + y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


class Cluster:
    """`store`: a Redis the test started (an EmbeddedCluster, say), with `connector` settings
    to reach it in `sections`; by default the cluster starts (and stops) its own. `lms`: LM
    workers (lm-0, lm-1, ...); `lm_roles`: their lm.role, one each (default: all both);
    `lm_env`: environment variables of each (EPD_LM_TENSOR_PARALLEL_SIZE, say)."""

    def __init__(
        self,
        workdir: Path,
        checkpoint: Path,
        encoders: int = 2,
        store=None,
        lms: int = 1,
        lm_roles: tuple[str, ...] = (),
        lm_env: tuple[dict[str, str], ...] = (),
        **sections,
    ):
        self.workdir = workdir
        self.own_redis = store is None
        self.redis = EmbeddedRedis().start() if store is None else store
        self.proxy_grpc, self.proxy_http = free_port(), free_port()
        self.encoder_addresses = [f"127.0.0.1:{free_port()}" for _ in range(encoders)]
        self.lm_addresses = [f"127.0.0.1:{free_port()}" for _ in range(lms)]
        self.lm_address = self.lm_addresses[0]
        config = {
            "model": {"path": str(checkpoint), "name": "tiny"},
            "connector": {"url": self.redis.url},
            "proxy": {
                "host": "127.0.0.1",
                "grpc_port": self.proxy_grpc,
                "http_port": self.proxy_http,
                "encoders": self.encoder_addresses,
                "lm_workers": self.lm_addresses,
                "load_poll_seconds": 0.2,
            },
            "lm": {
                "kv_cache_bytes": "64MiB",
                "max_num_seqs": 16,
                "max_num_batched_tokens": 256,
                "embedding_timeout_seconds": 20,
            },
            "registry": {"heartbeat_seconds": 0.3, "ttl_seconds": 1.0},
        }
        for section, values in sections.items():
            config.setdefault(section, {}).update(values)
        self.config_path = workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.roles: dict[str, RoleProcess] = {}
        for i, address in enumerate(self.encoder_addresses):
            self.start("encoder", f"encoder-{i}", address)
        self.lm_roles = tuple(lm_roles) or ("both",) * lms
        assert len(self.lm_roles) == lms, "one role per LM worker"
        lm_env = tuple(lm_env) or ({},) * lms
        for i, address in enumerate(self.lm_addresses):
            env = {"EPD_LM_ROLE": self.lm_roles[i], **lm_env[i]}
            self.start("lm", f"lm-{i}", address, env=env)
        self.start("proxy", "proxy", f"127.0.0.1:{self.proxy_grpc}")
        for role in self.roles.values():
            role.wait_status("SERVING", timeout=120)
        wait_proxy_sees_workers_serving(lambda: self.http("/health"))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.proxy_grpc}")
        self.stub = epd_pb2_grpc.InferenceStub(self.channel)

    def start(
        self, kind: str, name: str, address: str, env: dict[str, str] | None = None
    ) -> RoleProcess:
        extra = [] if kind == "proxy" else ["--listen", address]
        argv = epd_command(kind, "--config", str(self.config_path), "--name", name, *extra)
        child = Child(name, argv, env={**os.environ, **env} if env else None)
        role = self.roles[name] = RoleProcess(name, kind, address, child)
        return role

    def kill(self, name: str) -> None:
        self.roles[name].child.signal(signal.SIGKILL)
        self.roles[name].child.proc.wait(10)

    def stop(self) -> None:
        """The proxies first, then the workers, as `epd up` stops them: each group sent SIGTERM
        at once and then waited for, so its processes drain and exit side by side (one after
        another, a cluster's teardown took seconds more)."""
        self.channel.close()
        proxies = [r for r in self.roles.values() if r.kind == "proxy"]
        for group in (proxies, [r for r in self.roles.values() if r.kind != "proxy"]):
            for role in group:
                role.child.signal(signal.SIGTERM)
            for role in group:
                role.child.stop(20)
        if self.own_redis:
            self.redis.stop()

    def add_proxy(self, name: str) -> tuple[RoleProcess, int, int]:
        """Another proxy over the same workers and Redis: (role, gRPC port, HTTP port)."""
        config = yaml.safe_load(self.config_path.read_text())
        grpc_port, http_port = free_port(), free_port()
        config["proxy"].update(grpc_port=grpc_port, http_port=http_port)
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = epd_command("proxy", "--config", str(path), "--name", name)
        role = RoleProcess(name, "proxy", f"127.0.0.1:{grpc_port}", Child(name, argv))
        self.roles[name] = role
        return role, grpc_port, http_port

    # -- clients ------------------------------------------------------------------------------

    def generate(self, text: str, images=(), timeout: float = 60, stub=None, **sampling):
        """(token ids, the last response) of a chat request with images before the text;
        through `stub` (another proxy's) if given."""
        sampling.setdefault("temperature", 0.0)
        sampling.setdefault("ignore_eos", True)
        request = epd_pb2.GenerateRequest(
            media=[epd_pb2.MediaItem(image=b) for b in images],
            sampling=epd_pb2.SamplingParams(**sampling),
        )
        parts = [epd_pb2.ContentPart(media_index=i) for i in range(len(images))]
        parts.append(epd_pb2.ContentPart(text=text))
        request.chat.messages.add(role="user", content=parts)
        tokens, last = [], None
        for response in (stub or self.stub).Generate(request, timeout=timeout):
            tokens.extend(response.token_ids)
            last = response
        return tokens, last

    def http(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        return http_json(self.proxy_http, path, body)

    def metric(self, name: str, **labels) -> float:
        """A sample from the proxy's /metrics (0 when absent)."""
        url = f"http://127.0.0.1:{self.proxy_http}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if m and m.group(1) == name:
                got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
                if got == want:
                    return float(m.group(3))
        return 0.0

    def wait_metric(self, name: str, at_least: float, timeout: float = 20, **labels) -> float:
        """Until the proxy's metric reaches `at_least` (polled every 20 ms); its value."""
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) < at_least:
            assert time.monotonic() < deadline, f"{name}{labels} stayed at {value} < {at_least}"
            time.sleep(0.02)
        return value


def http_json(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (or a POST of `body`) to a proxy's HTTP port."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
