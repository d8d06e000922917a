"""Fixtures: the embedded Redis-compatible server and real role servers on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from common.process import Child, epd_command, free_port
from connector import EmbeddedRedis
from connector.embedded import EmbeddedCluster
from tests.helpers import TEST_CLUSTER_SECRET, RoleProcess


def pytest_configure(config):
    """Nothing a test writes for itself (the built-in model) goes to the user's cache."""
    import tempfile

    config._epd_cache = tempfile.TemporaryDirectory(prefix="epd-test-cache-")
    os.environ["EPD_CACHE_DIR"] = config._epd_cache.name
    # The cluster secret every role started by a test inherits (the proxy signs media hashes
    # with it, encoders check them); tests that call an encoder directly sign with it too.
    os.environ["EPD_CLUSTER_SECRET"] = TEST_CLUSTER_SECRET


def pytest_unconfigure(config):
    cache = getattr(config, "_epd_cache", None)
    if cache is not None:
        cache.cleanup()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint (milliseconds to write, to load, to run)."""
    from models.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "qwen2_5_vl", "tiny", seed=7)


@pytest.fixture(scope="session")
def builtin_cluster(tmp_path_factory):
    """The built-in model on a whole cluster (embedded Redis, two encoders, an LM worker, the
    proxy), shared by the modules that only send it requests (test_semantic, test_openai_api):
    each cluster start costs the suite ~15 s of its two cores. Batch-invariant: a request's
    tokens do not depend on what else ran beside it (the tests compare prompts sent together
    with each sent alone)."""
    from common.served_model import builtin_model
    from tests.cluster_helpers import Cluster

    c = Cluster(
        tmp_path_factory.mktemp("builtin-cluster"),
        builtin_model(),
        encoders=2,
        lm={"batch_invariant": True},
    )
    yield c
    c.stop()


@pytest.fixture(scope="session")
def tiny_ref(tiny_checkpoint):
    """The models' reference path on the tiny checkpoint: expected tokens for the tests."""
    from models.testing import ReferenceModel

    return ReferenceModel(tiny_checkpoint)


@pytest.fixture(params=[512, 256])
def vector_bits(request, monkeypatch) -> int:
    """Our C kernels (lm_worker/cpu_decode.c) in each vector width they are built in, loaded
    afresh for the test (cpu_kernels.c_library), and in the measured width again after it."""
    from lm_worker import cpu_kernels

    monkeypatch.setenv(cpu_kernels.VECTOR_ENV, str(request.param))
    cpu_kernels.c_library.cache_clear()
    yield request.param
    monkeypatch.undo()
    cpu_kernels.c_library.cache_clear()


@pytest.fixture
def redis_server():
    """A private valkey-server on a free loopback port, stopped (and its directory removed)
    after the test."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A private 3-master Redis Cluster of embedded valkey-servers on free loopback ports (about
    two seconds to form), shared by the tests of a session: use distinct keys per test."""
    with EmbeddedCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_with_replica():
    """3 masters, the first with a replica: for failover tests (it is killed, so not shared)."""
    with EmbeddedCluster(masters=3, replicas=1) as cluster:
        yield cluster


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


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA device: without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
