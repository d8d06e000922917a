"""The cluster across hosts: every role in its own network namespace, on one switch.

    redis 10.99.0.1   proxy 10.99.0.2   encoder 10.99.0.3   lm-a 10.99.0.4   lm-b 10.99.0.5
    client 10.99.0.6 (the test's HTTP agent)

Deployed the way compose and Kubernetes deploy it: each role listens on 0.0.0.0 in its own
host, workers advertise their host's address (EPD_ENCODER_ADVERTISE / EPD_LM_ADVERTISE) and
register through Redis, and the proxy has no static worker list. Nothing runs in the root
namespace but the test itself, which talks to the proxy only through the client host.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sys
import time

import pytest
import yaml

from common.process import Child
from connector.embedded import server_binary
from tests.cluster_helpers import image_bytes
from tests.netns import Agent, NetnsUnavailable, Switch, check_available, netns_inode

try:
    check_available()
except NetnsUnavailable as e:
    pytest.skip(f"multi-host tests need network namespaces: {e}", allow_module_level=True)

MAX_TOKENS = 8
ENCODER_PORT, LM_PORT, GRPC_PORT, HTTP_PORT = 50061, 50071, 50051, 8000


class MultiHostCluster:
    def __init__(self, workdir, checkpoint):
        self.children: dict[str, Child] = {}
        self.switch = Switch()
        self.agent = None
        try:
            self._start(workdir, checkpoint)
        except BaseException:
            self.stop()
            raise

    def _start(self, workdir, checkpoint) -> None:
        hosts = {
            n: self.switch.add_host(n)
            for n in ("redis", "proxy", "encoder", "lm-a", "lm-b", "client")
        }
        self.hosts = hosts
        redis_host = hosts["redis"]
        self.redis_dir = workdir / "redis"
        self.redis_dir.mkdir()
        flags = (
            "--protected-mode no --appendonly no --maxmemory 64mb --maxmemory-policy allkeys-lru"
        )
        argv = [str(server_binary()), "--bind", redis_host.address, "--port", "6379", "--save", ""]
        argv += [*flags.split(), "--dir", str(self.redis_dir)]
        argv += ["--logfile", str(self.redis_dir / "server.log")]
        self._spawn("redis", redis_host.command(*argv))
        config = {
            "model": {"path": str(checkpoint), "name": "tiny"},
            "connector": {
                "url": f"redis://{redis_host.address}:6379/0",
                "startup_wait_seconds": 30,
            },
            "proxy": {
                "host": "0.0.0.0",
                "grpc_port": GRPC_PORT,
                "http_port": HTTP_PORT,
                "load_poll_seconds": 0.2,
            },
            "encoder": {"listen": f"0.0.0.0:{ENCODER_PORT}"},
            "lm": {
                "listen": f"0.0.0.0:{LM_PORT}",
                "kv_cache_bytes": "64MiB",
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "embedding_timeout_seconds": 20,
            },
            "registry": {"heartbeat_seconds": 0.3, "ttl_seconds": 1.0},
        }
        self.config_path = workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.encoder = f"{hosts['encoder'].address}:{ENCODER_PORT}"
        self.lms = [f"{hosts[n].address}:{LM_PORT}" for n in ("lm-a", "lm-b")]
        self._role("encoder", "encoder", EPD_ENCODER_ADVERTISE=self.encoder)
        self._role("lm", "lm-a", EPD_LM_ADVERTISE=self.lms[0])
        self._role("lm", "lm-b", EPD_LM_ADVERTISE=self.lms[1])
        self._role("proxy", "proxy")
        self.agent = Agent(hosts["client"])
        self.base = f"http://{hosts['proxy'].address}:{HTTP_PORT}"

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.children[name] = Child(name, argv, env=env)

    def _role(self, kind: str, name: str, **env: str) -> None:
        argv = self.hosts[name].command(
            sys.executable, "-m", "epd", kind, "--config", str(self.config_path), "--name", name
        )
        # One compute thread per role: five processes share two cores.
        self._spawn(name, argv, env={**os.environ, "OMP_NUM_THREADS": "1", **env})

    def stop(self) -> None:
        try:
            if self.agent is not None:
                self.agent.close()
            # The proxy first, then the workers together (each drains), Redis last.
            workers = [c for n, c in self.children.items() if n not in ("proxy", "redis")]
            if "proxy" in self.children:
                self.children["proxy"].stop(20)
            for child in workers:
                child.signal(signal.SIGTERM)
            for child in workers + [c for n, c in self.children.items() if n == "redis"]:
                child.stop(20)
        finally:
            self.switch.close()

    # -- through the client host --------------------------------------------------------------

    def check_alive(self) -> None:
        for name, child in self.children.items():
            assert child.poll() is None, f"{name} exited with {child.poll()}"

    def health(self) -> tuple[int, dict]:
        status, text = self.agent.request(self.base + "/health", timeout=5)
        return status, (json.loads(text) if status else {})

    def worker_status(self, role: str) -> dict[str, str]:
        status, body = self.health()
        if status not in (200, 503) or "roles" not in body:
            return {}
        return {w["address"]: w["status"] for w in body["roles"][role]["workers"]}

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample from the proxy's /metrics (None when absent)."""
        status, text = self.agent.request(self.base + "/metrics", timeout=5)
        assert status == 200, text
        want = {f'{k}="{v}"' for k, v in labels.items()}
        for line in text.splitlines():
            m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            got = set(filter(None, (m.group(2) or "").split(","))) if m else None
            if m and m.group(1) == name and got == want:
                return float(m.group(3))
        return None

    def wait_for(self, what: str, condition, timeout: float) -> float:
        """Seconds until condition() held; fails naming `what` after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            self.check_alive()
            if condition():
                return time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"{what}: not after {timeout:.0f}s (health: {self.health()})")

    def chat(self, text: str, image: bytes | None = None) -> dict:
        content = [{"type": "text", "text": text}]
        if image is not None:
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, reply = self.agent.request(self.base + "/v1/chat/completions", body, timeout=60)
        assert status == 200, reply
        return json.loads(reply)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from models.testing import make_checkpoint

    workdir = tmp_path_factory.mktemp("multihost")
    checkpoint = make_checkpoint(workdir / "tiny", "qwen2_5_vl", "tiny", seed=11)
    c = MultiHostCluster(workdir, checkpoint)
    try:
        all_up = {c.encoder: "SERVING"}, {lm: "SERVING" for lm in c.lms}
        c.wait_for(
            "every worker registered and SERVING in the proxy",
            lambda: (c.worker_status("encoder"), c.worker_status("lm")) == all_up,
            timeout=90,
        )
        yield c
    finally:
        c.stop()


def test_every_role_runs_in_its_own_network_namespace(cluster):
    ours = netns_inode("self")
    seen = {name: netns_inode(child.pid) for name, child in cluster.children.items()}
    assert ours not in seen.values()  # nothing listens in the root namespace
    assert len(set(seen.values())) == len(seen)  # one host each
    status, body = cluster.health()
    assert status == 200 and body["status"] == "healthy"
    for role in ("encoder", "lm"):
        assert {w["source"] for w in body["roles"][role]["workers"]} == {"registry"}


def test_a_request_crosses_the_hosts(cluster):
    encoded_before = cluster.metric("epd_mm_items_total", result="encoded") or 0
    reply = cluster.chat("What is in the picture?", image_bytes(64, 64, seed=1))
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS and choice["finish_reason"] == "length"
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded_before + 1


def test_a_cut_link_takes_the_worker_out_and_traffic_goes_around_it(cluster):
    image = image_bytes(64, 48, seed=2)
    before = cluster.chat("Describe it", image)["choices"][0]["token_ids"]
    # Idle workers tie on load and the proxy then picks the lowest address: lm-a took that
    # request, and takes every request while it is up.
    lm_a, lm_b = cluster.lms
    cluster.switch.cut(cluster.hosts["lm-a"])
    took = cluster.wait_for(
        "lm-a out of rotation after its link was cut",
        lambda: (
            cluster.worker_status("lm").get(lm_a) != "SERVING"
            and cluster.metric("epd_worker_up", role="lm", worker=lm_a) == 0
        ),
        timeout=15,
    )
    status, body = cluster.health()
    assert status == 200 and body["roles"]["lm"]["status"] in ("healthy", "degraded")
    assert cluster.worker_status("lm").get(lm_b) == "SERVING"
    assert cluster.metric("epd_worker_up", role="lm", worker=lm_b) == 1

    # The same request on lm-b (the image now held in Redis) gives the same greedy tokens, and
    # a new image is encoded and served without lm-a.
    assert cluster.chat("Describe it", image)["choices"][0]["token_ids"] == before
    assert (
        len(cluster.chat("And this one?", image_bytes(40, 72, seed=3))["choices"][0]["token_ids"])
        == MAX_TOKENS
    )

    # Plugged back in, lm-a heartbeats again and the proxy takes it back without a restart.
    cluster.switch.plug(cluster.hosts["lm-a"])
    cluster.wait_for(
        "lm-a back in rotation after its link came back",
        lambda: cluster.metric("epd_worker_up", role="lm", worker=lm_a) == 1,
        timeout=30,
    )
    assert cluster.chat("Describe it", image)["choices"][0]["token_ids"] == before
    print(f"lm-a out of rotation {took:.1f}s after its link was cut")
