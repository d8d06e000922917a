"""`epd up`: the whole cluster comes to SERVING, answers, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest

from common.health import health_status
from common.process import epd_command, free_port, port_is_free
from proto import epd_pb2, epd_pb2_grpc


class Up:
    """`epd up` as a child process; reads its stdout until the cluster says SERVING."""

    def __init__(self, *args: str, env: dict | None = None):
        self.grpc_port, self.http_port = free_port(), free_port()
        argv = epd_command(
            "up", "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), *args
        )
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A small KV cache: these tests start several clusters on one 2-core machine.
            env={**os.environ, "EPD_LM_KV_CACHE_BYTES": "64MiB", **(env or {})},
        )
        self.stdout: list[str] = []

    def wait_serving(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.stdout.append(line)
            if line.startswith("Ctrl-C stops the cluster"):
                return
            assert time.monotonic() < deadline, "epd up did not print its endpoints in time"
        raise AssertionError(f"epd up ended before SERVING: {self.proc.stderr.read()}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def http_get(self, path: str) -> tuple[int, dict]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def assert_all_gone(processes: list[psutil.Process], timeout: float = 15) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture
def up(tiny_checkpoint):
    """up(*args) -> a started `epd up` on the tiny model (builtin=True: on the default one)."""
    started: list[Up] = []

    def start(*args, builtin: bool = False, **kwargs) -> Up:
        model = () if builtin else ("--model", str(tiny_checkpoint))
        started.append(Up(*model, *args, **kwargs))
        return started[-1]

    yield start
    for u in started:
        if u.proc.poll() is None:
            u.proc.kill()
        u.proc.wait()


def test_up_serves_and_ctrl_c_leaves_nothing_behind(up, tmp_path):
    # No --model: the built-in model, shipped with the package.
    cluster = up("--encoders", "2", "--lm-workers", "1", builtin=True)
    cluster.wait_serving()
    out = "".join(cluster.stdout)
    assert f"127.0.0.1:{cluster.grpc_port}" in out
    assert "encoder-1" in out and "lm-0" in out and "(embedded)" in out

    children = cluster.descendants()
    names = [" ".join(p.cmdline()) for p in children]
    assert sum("epd encoder" in n for n in names) == 2
    assert sum("epd lm" in n for n in names) == 1
    assert sum("epd proxy" in n for n in names) == 1
    assert sum("valkey-server" in n for n in names) == 1

    assert health_status(f"127.0.0.1:{cluster.grpc_port}") == "SERVING"
    status, health = cluster.http_get("/health")
    assert status == 200 and health["status"] == "healthy"
    assert len(health["roles"]["encoder"]["workers"]) == 2
    status, models = cluster.http_get("/v1/models")
    assert status == 200 and models["data"][0]["id"] == "epd-builtin"
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        reply = epd_pb2_grpc.InferenceStub(channel).ListModels(epd_pb2.ListModelsRequest())
    assert reply.models[0].id == "epd-builtin"

    # The README's quick start: a picture drawn by `epd scene`, asked about with `epd
    # generate`, answered by the built-in model through the proxy, an encoder and the LM worker.
    picture = tmp_path / "scene.png"
    drawn = subprocess.run(
        epd_command("scene", str(picture)), capture_output=True, text=True, timeout=60
    )
    assert drawn.returncode == 0, drawn.stderr
    result = subprocess.run(
        epd_command(
            "generate",
            "How many shapes are there?",
            "--image",
            str(picture),
            "--target",
            f"127.0.0.1:{cluster.grpc_port}",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "two"

    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(60) == 0
    assert_all_gone(children)
    for port in (cluster.grpc_port, cluster.http_port):
        assert port_is_free("127.0.0.1", port)
    assert "cluster stopped" in cluster.proc.stderr.read()


def test_killed_launcher_takes_its_children_with_it(up):
    cluster = up()
    cluster.wait_serving()
    children = cluster.descendants()
    assert len(children) == 4
    cluster.proc.kill()
    assert_all_gone(children)


def test_role_failing_at_startup_stops_everything_with_its_name(up):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    cluster = up("--redis-url", dead_redis, env={"EPD_CONNECTOR_STARTUP_WAIT_SECONDS": "0.5"})
    assert cluster.proc.wait(60) == 1
    err = cluster.proc.stderr.read()
    assert "exited with code 1 during start-up" in err
    assert "did not answer within" in err  # the role's own log says why


def test_port_in_use_is_refused_before_anything_starts(up):
    cluster = up()
    cluster.wait_serving()
    second = subprocess.run(
        epd_command("up", "--grpc-port", str(cluster.grpc_port), "--http-port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert f"port {cluster.grpc_port} on 127.0.0.1 is in use: pass another --grpc-port" in (
        second.stderr
    )


def test_bad_flag_value_is_a_config_error():
    result = subprocess.run(
        [sys.executable, "-m", "epd", "up", "--http-port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "proxy.http_port: must be a port in 1..65535, got 70000" in result.stderr
