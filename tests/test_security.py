"""Security, tried as an attacker would: API keys, TLS for clients, mTLS between the proxy and
the workers, tenants kept apart in the embedding cache, hashes only the proxy can assign,
and secrets kept out of argv, files and `epd config`.

One cluster of real processes (embedded Redis, an encoder, an LM worker, the proxy) runs with
everything on: API keys for two tenants, HTTPS and gRPC TLS for clients, mTLS inside, with
certificates made here by a test CA.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from common.config import ClusterConfig, ConfigError, ConnectorConfig, dump_config, load_config
from common.health import health_status
from common.process import Child, epd_command, free_port
from common.served_model import resolve_model
from connector import ECConnector, EmbeddedRedis
from models import MediaInput
from models.testing import ImageItem, ReferenceModel
from proto import epd_pb2, epd_pb2_grpc
from proxy.auth import KeyRing, Unauthenticated, read_keys_file
from proxy.prepare import mm_hash
from tests.certs import CA
from tests.cluster_helpers import image_bytes, wait_proxy_sees_workers_serving
from tests.helpers import RoleProcess, sign, wait_until

MAX_TOKENS = 8
KEY_A, KEY_B, KEY_C = "key-tenant-a-0001", "key-tenant-b-0002", "key-from-env-0003"


@pytest.fixture(scope="module")
def ref(tiny_checkpoint):
    return ReferenceModel(tiny_checkpoint)


def expected(ref: ReferenceModel, text: str, images=()) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ref.generate(
        [{"role": "user", "content": content}],
        [ImageItem(b) for b in images],
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )


class SecureCluster:
    """Keys, client TLS and mTLS on; each role a real process."""

    def __init__(self, workdir: Path, checkpoint: Path):
        self.workdir = workdir
        self.ca = CA(workdir / "pki")
        self.other_ca = CA(workdir / "pki-other", "intruder-ca")
        self.proxy_pem = self.ca.issue("proxy")
        self.worker_pem = self.ca.issue("epd-worker")
        self.intruder_pem = self.other_ca.issue("intruder")
        keys_file = workdir / "api-keys"
        keys_file.write_text(f"# tenant keys\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
        keys_file.chmod(0o600)
        self.redis = EmbeddedRedis().start()
        self.grpc_port, self.http_port = free_port(), free_port()
        self.encoder = f"127.0.0.1:{free_port()}"
        self.lm = f"127.0.0.1:{free_port()}"
        config = {
            "model": {"path": str(checkpoint), "name": "tiny"},
            "connector": {"url": self.redis.url},
            "proxy": {
                "grpc_port": self.grpc_port,
                "http_port": self.http_port,
                "encoders": [self.encoder],
                "lm_workers": [self.lm],
                "load_poll_seconds": 0.2,
                "api_keys_file": str(keys_file),
                "tls_cert": str(self.proxy_pem.cert),
                "tls_key": str(self.proxy_pem.key),
            },
            "lm": {"kv_cache_bytes": "32MiB", "max_num_seqs": 8, "max_num_batched_tokens": 256},
            "registry": {"enabled": False},
            "cluster": {"tls": self.tls_section(self.worker_pem)},
        }
        self.config_path = workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.env = {**os.environ, "EPD_PROXY_API_KEYS": KEY_C}
        self.roles = [
            self._start("encoder", self.encoder),
            self._start("lm", self.lm),
            self._start("proxy", f"127.0.0.1:{self.grpc_port}"),
        ]
        self.tls = load_config(self.config_path).cluster.tls
        self._wait()
        detail = {"Authorization": f"Bearer {KEY_A}"}  # /health's detail needs a key
        wait_proxy_sees_workers_serving(lambda: self.https("/health", headers=detail)[:2])
        self.channel = self.client_channel()
        self.stub = epd_pb2_grpc.InferenceStub(self.channel)

    def tls_section(self, pem) -> dict:
        return {"ca": str(self.ca.pem.cert), "cert": str(pem.cert), "key": str(pem.key)}

    def _start(self, kind: str, address: str) -> RoleProcess:
        extra = [] if kind == "proxy" else ["--listen", address]
        argv = epd_command(kind, "--config", str(self.config_path), "--name", kind, *extra)
        return RoleProcess(kind, kind, address, Child(kind, argv, env=self.env))

    def _wait(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for role in self.roles:
            while True:
                assert role.child.poll() is None, f"{role.name} exited"
                if role.kind == "proxy":
                    status = self._proxy_health()
                else:
                    status = health_status(role.address, timeout=0.5, tls=self.tls)
                if status == "SERVING":
                    break
                assert time.monotonic() < deadline, f"{role.name}: {status}"
                time.sleep(0.1)

    def _proxy_health(self) -> str:
        with self.client_channel() as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=0.5
                )
            except grpc.RpcError:
                return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def client_channel(self) -> grpc.Channel:
        """A client's channel to the proxy: TLS, checked against the test CA."""
        roots = self.ca.pem.cert.read_bytes()
        return grpc.secure_channel(
            f"localhost:{self.grpc_port}", grpc.ssl_channel_credentials(roots)
        )

    def https(self, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
        """(status, JSON body or {}, headers) over HTTPS, checked against the test CA."""
        context = ssl.create_default_context(cafile=str(self.ca.pem.cert))
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"https://localhost:{self.http_port}{path}",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as reply:
                raw = reply.read()
                status, got = reply.status, dict(reply.headers)
        except urllib.error.HTTPError as e:
            raw, status, got = e.read(), e.code, dict(e.headers)
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {}
        return status, parsed, got

    def generate(self, key: str | None, text: str, images=(), uuids=(), **sampling):
        sampling.setdefault("temperature", 0.0)
        sampling.setdefault("ignore_eos", True)
        sampling.setdefault("max_tokens", MAX_TOKENS)
        media = [epd_pb2.MediaItem(image=b) for b in images]
        for item, u in zip(media, uuids, strict=False):
            item.uuid = u
        request = epd_pb2.GenerateRequest(media=media, sampling=epd_pb2.SamplingParams(**sampling))
        parts = [epd_pb2.ContentPart(media_index=i) for i in range(len(images))]
        parts.append(epd_pb2.ContentPart(text=text))
        request.chat.messages.add(role="user", content=parts)
        tokens, last = [], None
        for response in self.stub.Generate(request, timeout=60, metadata=bearer(key)):
            tokens.extend(response.token_ids)
            last = response
        return tokens, last

    def stop(self) -> None:
        self.channel.close()
        for role in reversed(self.roles):
            role.child.stop(20)
        self.redis.stop()


def bearer(key: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {key}")] if key else None


@pytest.fixture(scope="module")
def secure(tmp_path_factory, tiny_checkpoint):
    c = SecureCluster(tmp_path_factory.mktemp("secure"), tiny_checkpoint)
    yield c
    c.stop()


# -- API keys -----------------------------------------------------------------------------------


def test_http_no_key_wrong_key_right_key(secure):
    # Greedy and past EOS: exactly two tokens whatever the random model says.
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, body, headers = secure.https("/v1/chat/completions", chat)
    assert status == 401 and "API key is required" in body["error"]["message"]
    assert headers["WWW-Authenticate"].startswith("Bearer")
    wrong = {"Authorization": "Bearer not-a-key"}
    status, body, _ = secure.https("/v1/chat/completions", chat, wrong)
    assert status == 401 and "not valid" in body["error"]["message"]
    for key in (KEY_A, KEY_B, KEY_C):  # the file's two tenants and the environment's key
        status, body, _ = secure.https(
            "/v1/chat/completions", chat, {"Authorization": f"Bearer {key}"}
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 2
    assert secure.https("/v1/models")[0] == 401
    assert secure.https("/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})[0] == 200


def test_health_open_metrics_and_dashboard_behind_the_key(secure):
    # Open, but without a key only healthy or not: no worker addresses, no last errors.
    for headers in (None, {"Authorization": "Bearer not-a-key"}):
        status, body, _ = secure.https("/health", headers=headers)
        assert (status, body) == (200, {"status": "healthy"}), headers
    status, body, _ = secure.https("/health", headers={"Authorization": f"Bearer {KEY_C}"})
    assert status == 200 and body["status"] == "healthy"
    assert [w["address"] for w in body["roles"]["lm"]["workers"]] == [secure.lm]
    assert secure.https("/metrics")[0] == 401
    assert secure.https("/metrics", headers={"Authorization": f"Bearer {KEY_B}"})[0] == 200
    status, _, headers = secure.https("/dashboard")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")  # browser prompt
    basic = base64.b64encode(f"any-user:{KEY_A}".encode()).decode()
    status, _, _ = secure.https("/dashboard/state", headers={"Authorization": f"Basic {basic}"})
    assert status == 200
    bad = base64.b64encode(b"any-user:guess").decode()
    assert secure.https("/dashboard", headers={"Authorization": f"Basic {bad}"})[0] == 401


def test_grpc_every_inference_method_needs_a_key(secure):
    calls = {
        "Generate": lambda md: list(
            secure.stub.Generate(
                epd_pb2.GenerateRequest(text="hi", sampling=epd_pb2.SamplingParams(max_tokens=1)),
                timeout=30,
                metadata=md,
            )
        ),
        "Abort": lambda md: secure.stub.Abort(
            epd_pb2.AbortRequest(request_id="x"), timeout=10, metadata=md
        ),
        "ListModels": lambda md: secure.stub.ListModels(
            epd_pb2.ListModelsRequest(), timeout=10, metadata=md
        ),
        "Realtime": lambda md: list(secure.stub.Realtime(iter(()), timeout=10, metadata=md)),
    }
    service = epd_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert set(calls) == {m.name for m in service.methods}  # a new method is covered here too
    for name, call in calls.items():
        for metadata in (None, bearer("wrong-key"), [("authorization", KEY_A)]):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
    assert secure.stub.ListModels(epd_pb2.ListModelsRequest(), metadata=bearer(KEY_B)).models
    tokens, last = secure.generate(KEY_A, "Hello there")
    assert len(tokens) == MAX_TOKENS and last.finish_reason == epd_pb2.FINISH_REASON_LENGTH


def test_keys_compared_whole_and_file_format(tmp_path):
    keys = KeyRing([("abc123", "t1"), ("zzz999", None)])
    assert keys.check("abc123").tenant == "t1"
    assert keys.check("zzz999").tenant.startswith("key-")  # no tenant named: one of its own
    for guess in ("abc12", "abc1234", "ABC123", "", None):
        with pytest.raises(Unauthenticated):
            keys.check(guess)
    assert keys.check("abc123").key_id != keys.check("zzz999").key_id
    with pytest.raises(ConfigError, match="twice"):
        KeyRing([("same", None), ("same", "t")])
    assert not KeyRing([]).enabled  # no keys: open (the proxy warns off loopback)
    path = tmp_path / "keys"
    path.write_text("# comment\n\nk-one team-1  # trailing comment\nk-two\n")
    assert read_keys_file(str(path)) == [("k-one", "team-1"), ("k-two", None)]
    path.write_text("k-one team-1 extra\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_keys_file(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        read_keys_file(str(tmp_path / "missing"))


# -- TLS and mTLS -------------------------------------------------------------------------------


def test_proxy_refuses_plaintext_clients(secure):
    plain = grpc.insecure_channel(f"127.0.0.1:{secure.grpc_port}")
    with plain as channel, pytest.raises(grpc.RpcError) as e:
        epd_pb2_grpc.InferenceStub(channel).ListModels(
            epd_pb2.ListModelsRequest(), timeout=5, metadata=bearer(KEY_A)
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # closed without a reply
        urllib.request.urlopen(f"http://127.0.0.1:{secure.http_port}/health", timeout=5)


@pytest.mark.parametrize("role", ["encoder", "lm"])
def test_worker_refuses_a_client_without_the_cluster_certificate(secure, role):
    address = secure.encoder if role == "encoder" else secure.lm
    port = address.rpartition(":")[2]
    roots = secure.ca.pem.cert.read_bytes()
    intruder = secure.intruder_pem
    attempts = {
        "plaintext": grpc.insecure_channel(address),
        "TLS, no client certificate": grpc.secure_channel(
            f"localhost:{port}", grpc.ssl_channel_credentials(roots)
        ),
        "a certificate from another CA": grpc.secure_channel(
            f"localhost:{port}",
            grpc.ssl_channel_credentials(
                roots, intruder.key.read_bytes(), intruder.cert.read_bytes()
            ),
        ),
    }
    for what, channel in attempts.items():
        with channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, what
            if role == "lm":
                with pytest.raises(grpc.RpcError):
                    epd_pb2_grpc.LanguageModelStub(channel).Abort(
                        epd_pb2.AbortRequest(request_id="anything"), timeout=5
                    )
    # The cluster's certificate (what the proxy presents) is let in, health checks included.
    assert health_status(address, timeout=5, tls=secure.tls) == "SERVING"


def test_epd_health_over_mtls(secure):
    """`epd health` (container and Kubernetes exec probes) reads cluster.tls from the
    environment or --config: SERVING over mTLS; without the certificate it cannot check."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_CLUSTER_TLS")}
    base = [sys.executable, "-m", "epd", "health", secure.lm, "--timeout", "5"]
    plain = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and plain.stdout.strip() == "UNREACHABLE"
    tls = {
        "EPD_CLUSTER_TLS_CA": str(secure.ca.pem.cert),
        "EPD_CLUSTER_TLS_CERT": str(secure.worker_pem.cert),
        "EPD_CLUSTER_TLS_KEY": str(secure.worker_pem.key),
    }
    ok = subprocess.run(base, env={**env, **tls}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    by_file = [*base, "--config", str(secure.config_path)]
    ok = subprocess.run(by_file, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


# -- tenants and the embedding cache ------------------------------------------------------------


def test_uuid_of_another_tenant_is_another_item(secure, ref):
    """Image B sent by tenant B with uuid x, after tenant A's image A with uuid x, is answered
    from B's own embedding (it was answered from A's before tenants scoped uuids)."""
    # One size (the embeddings fit either prompt), different outputs.
    image_a, image_b = image_bytes(96, 64, 1), image_bytes(96, 64, 3)
    tokens_a, _ = secure.generate(KEY_A, "What is it?", [image_a], ["x"])
    assert tokens_a == expected(ref, "What is it?", [image_a])
    tokens_b, last_b = secure.generate(KEY_B, "What is it?", [image_b], ["x"])
    assert last_b.usage.mm_items_encoded == 1  # not served from tenant A's entry
    assert tokens_b == expected(ref, "What is it?", [image_b])
    assert tokens_b != tokens_a
    # Within a tenant a uuid stays the client's promise (what lets it skip re-encoding).
    again, last = secure.generate(KEY_A, "What is it?", [image_a], ["x"])
    assert again == tokens_a and last.usage.mm_items_held == 1


def test_encoder_port_cannot_store_under_a_hash_it_was_not_given(secure, ref):
    """The attacker reaches the encoder's port with a valid cluster certificate (a stolen
    one, or a worker's) and asks it to store image A's embedding under image D's content
    hash. Unsigned or signed with the wrong secret, the item is refused and nothing is stored;
    an ordinary request for D then gets D's own embedding."""
    image_a, image_d = image_bytes(96, 64, 5), image_bytes(96, 64, 6)
    assert expected(ref, "And this?", [image_a]) != expected(ref, "And this?", [image_d])
    fingerprint = resolve_model(load_config(secure.config_path)).fingerprint
    hash_d = mm_hash(fingerprint, MediaInput("image", image=image_d))
    forged = {
        "no tag": b"",
        "a tag for another hash": sign("0" * 40),
        "a tag made with another secret": b"\x00" * 32,
    }
    cache = ECConnector(url=secure.redis.url, fingerprint=fingerprint, registry=None)
    try:
        with grpc.secure_channel(
            f"localhost:{secure.encoder.rpartition(':')[2]}",
            grpc.ssl_channel_credentials(
                secure.ca.pem.cert.read_bytes(),
                secure.worker_pem.key.read_bytes(),
                secure.worker_pem.cert.read_bytes(),
            ),
        ) as channel:
            stub = epd_pb2_grpc.EncoderStub(channel)
            for what, tag in forged.items():
                item = epd_pb2.EncodeItem(
                    mm_hash=hash_d, media=epd_pb2.MediaItem(image=image_a), mm_hash_tag=tag
                )
                reply = stub.Encode(epd_pb2.EncodeRequest(items=[item]), timeout=30)
                result = reply.results[0]
                assert result.outcome == epd_pb2.ENCODE_OUTCOME_FAILED, what
                assert result.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0], what
                assert "only the proxy assigns hashes" in result.error.message
                assert cache.has_many([hash_d]) == [False], what
        tokens, last = secure.generate(KEY_B, "And this?", [image_d])
        assert last.usage.mm_items_encoded == 1
        assert tokens == expected(ref, "And this?", [image_d])
    finally:
        cache.close()


def test_abort_only_by_the_key_that_started_it(secure):
    request = epd_pb2.GenerateRequest(
        request_id="long-running-a",
        text="Count forever",
        sampling=epd_pb2.SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0),
    )
    stream = secure.stub.Generate(request, timeout=120, metadata=bearer(KEY_A))
    first = next(stream)  # running
    assert first.token_ids
    finish: list = []  # one per response

    def read() -> None:
        for response in stream:
            finish.append(response.finish_reason)

    reader = threading.Thread(target=read)
    reader.start()
    abort = epd_pb2.AbortRequest(request_id="long-running-a")
    assert not secure.stub.Abort(abort, timeout=10, metadata=bearer(KEY_B)).aborted
    assert not secure.stub.Abort(abort, timeout=10, metadata=bearer(KEY_C)).aborted
    # Still generating after the other tenants' attempts: an abort ends the stream within a
    # step or two, so it goes on to 32 more responses (or ends, and fails below).
    attempted = len(finish)
    wait_until(
        lambda: len(finish) >= attempted + 32 or not reader.is_alive(),
        "32 more responses after the other tenants' abort attempts",
    )
    assert reader.is_alive() and epd_pb2.FINISH_REASON_ABORT not in finish
    # Another key starts a request under the same id and aborts it: only its own one ends.
    collider = secure.stub.Generate(request, timeout=120, metadata=bearer(KEY_B))
    assert next(collider).token_ids
    assert secure.stub.Abort(abort, timeout=10, metadata=bearer(KEY_B)).aborted
    theirs = [r.finish_reason for r in collider]
    assert theirs[-1] == epd_pb2.FINISH_REASON_ABORT
    attempted = len(finish)
    wait_until(
        lambda: len(finish) >= attempted + 32 or not reader.is_alive(),
        "32 more responses after the other key aborted its own request of the same id",
    )
    assert reader.is_alive() and epd_pb2.FINISH_REASON_ABORT not in finish
    assert secure.stub.Abort(abort, timeout=10, metadata=bearer(KEY_A)).aborted
    reader.join(60)
    assert finish[-1] == epd_pb2.FINISH_REASON_ABORT


# -- secrets: never in argv, files or `epd config` ---------------------------------------------


def test_epd_up_keeps_the_tenants_of_its_keys_file(tmp_path, monkeypatch):
    """`epd up --api-key-file F`: the keys F puts in one tenant share it at the proxy (`epd up`
    once passed on the keys alone, each then a tenant of its own); `--api-key` keys count too.
    What the proxy gets is read as it reads it: the file the launcher writes, and the
    environment it is given."""
    import epd.launcher
    from common.config import secret_env
    from epd.cli import main

    seen: list[ClusterConfig] = []

    def capture(config, **_):
        seen.append(config)
        raise epd.launcher.LaunchError("captured")

    monkeypatch.setattr(epd.launcher, "LocalCluster", capture)
    monkeypatch.delenv("EPD_PROXY_API_KEYS", raising=False)
    (tmp_path / "keys").write_text("key-one-0006 team\nkey-two-0007 team\nkey-three-0008\n")
    monkeypatch.chdir(tmp_path)
    assert main(["up", "--api-key-file", "keys", "--api-key", "argv-key-0009"]) == 2
    dump_config(seen[0], tmp_path / "cluster.yaml")
    monkeypatch.chdir("/")  # the proxy runs elsewhere
    proxy = load_config(tmp_path / "cluster.yaml", environ=secret_env(seen[0])).proxy
    keys = KeyRing.from_config(proxy)
    assert keys.check("key-one-0006").tenant == keys.check("key-two-0007").tenant == "team"
    assert keys.check("key-three-0008").tenant not in ("team", keys.check("argv-key-0009").tenant)
    assert "key-one" not in (tmp_path / "cluster.yaml").read_text()  # the file names the file


def test_secrets_redacted_in_epd_config_and_left_out_of_dumped_files(tmp_path):
    env = {
        **os.environ,
        "EPD_PROXY_API_KEYS": "sekrit-key-1,sekrit-key-2",
        "EPD_CONNECTOR_PASSWORD": "sekrit-redis-pw",
        "EPD_CLUSTER_SECRET": "sekrit-cluster-secret-0123",
    }
    for extra in ([], ["--env"]):
        out = subprocess.run(
            [*epd_command("config"), *extra], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert "sekrit" not in out.stdout
        assert "<redacted>" in out.stdout
    config = load_config(environ={k: v for k, v in env.items() if k.startswith("EPD_")})
    assert config.proxy.api_keys == ("sekrit-key-1", "sekrit-key-2")
    dump_config(config, tmp_path / "c.yaml")
    assert "sekrit" not in (tmp_path / "c.yaml").read_text()


def test_redis_password_and_tls_files_join_the_url_in_memory_only(tmp_path):
    pw = tmp_path / "redis-password"
    pw.write_text("p@ss word/1\n")
    c = ConnectorConfig(url="rediss://epd@db:6380/0", password_file=str(pw), tls_ca="/ca.pem")
    assert c.redis_url == "rediss://epd:p%40ss%20word%2F1@db:6380/0?ssl_ca_certs=%2Fca.pem"
    with pytest.raises(ConfigError, match="already holds a password"):
        _ = ConnectorConfig(url="redis://u:pw@db:6379/0", password="other").redis_url
    with pytest.raises(ConfigError, match="rediss://"):
        ConnectorConfig(url="redis://db:6379/0", tls_ca="/ca.pem")
    with pytest.raises(ConfigError, match=r"cluster\.secret"):
        ClusterConfig(connector=ConnectorConfig(url="redis://h:1/0")).check_role("encoder")
    out = subprocess.run(
        [*epd_command("up"), "--redis-url", "redis://u:hunter2@127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "EPD_CONNECTOR_PASSWORD" in out.stderr
    assert "hunter2" not in out.stderr


def test_embedded_redis_password_from_stdin_and_bounded_memory():
    with EmbeddedRedis(maxmemory="64mb", password="generated-pw-123") as server:
        argv = Path(f"/proc/{server.child.pid}/cmdline").read_bytes().decode()
        assert "generated-pw-123" not in argv
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        client = redis.Redis.from_url(server.url, password="generated-pw-123")
        assert client.ping()
        assert client.config_get("maxmemory")["maxmemory"] == str(64 * 1024 * 1024)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        client.close()


# -- Redis over TLS with an ACL user (Debian's redis-server; the embedded valkey has no TLS) ----

REDIS_SERVER = shutil.which("redis-server")


@pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="needs Debian's redis-server for TLS (apt-get install redis-server; .ci/run does)",
)
def test_redis_tls_with_an_acl_user(tmp_path):
    ca = CA(tmp_path / "pki")
    server_pem = ca.issue("redis")
    port = free_port()
    conf = "\n".join(
        [
            "port 0",
            f"tls-port {port}",
            "bind 127.0.0.1",
            f"tls-cert-file {server_pem.cert}",
            f"tls-key-file {server_pem.key}",
            f"tls-ca-cert-file {ca.pem.cert}",
            "tls-auth-clients no",
            'save ""',
            "appendonly no",
            f"dir {tmp_path}",
            "user default off",
            "user epd on >acl-pw-456 ~epd:* &epd:* +@all -@dangerous +info +flushall",
        ]
    )
    child = Child("redis-tls", [REDIS_SERVER, "-"], stdin=subprocess.PIPE)
    child.proc.stdin.write(conf.encode())
    child.proc.stdin.close()
    try:
        pw = tmp_path / "pw"
        pw.write_text("acl-pw-456")
        good = ConnectorConfig(
            url=f"rediss://epd@localhost:{port}/0",
            password_file=str(pw),
            tls_ca=str(ca.pem.cert),
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(good.redis_url).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and child.poll() is None
                time.sleep(0.05)
        cache = ECConnector(fingerprint="f", registry=None, **good.connector_options())
        import torch

        cache.put("a" * 40, torch.ones(3, 8))
        assert torch.equal(cache.get_many(["a" * 40])[0]["a" * 40], torch.ones(3, 8))
        cache.close()
        # Plaintext, the wrong password, or the disabled default user: refused.
        with pytest.raises(redis.ConnectionError):
            redis.Redis(host="localhost", port=port, socket_timeout=2).ping()
        for url, password in (
            (f"rediss://epd@localhost:{port}/0", "wrong"),
            (f"rediss://localhost:{port}/0", "acl-pw-456"),
        ):
            bad = ConnectorConfig(url=url, password=password, tls_ca=str(ca.pem.cert))
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(bad.redis_url).ping()
        # The ACL keeps the user to the cluster's namespace.
        client = redis.Redis.from_url(good.redis_url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("elsewhere", b"1")
        client.close()
    finally:
        child.stop(10)


# -- epd up: secrets to the children by environment, TLS for clients ---------------------------


def test_epd_up_keeps_secrets_out_of_argv_and_files(tmp_path, tiny_checkpoint):
    """`epd up --api-key ... --tls-cert --tls-key`, with mTLS inside (cluster.tls in its
    config): the key, the generated cluster secret and the embedded Redis's generated password
    reach the roles through their environment; no child's argv and no file the launcher writes
    holds them. The launcher's health checks pass over mTLS; clients need TLS and the key."""
    import psutil

    from tests.test_up import Up

    ca = CA(tmp_path / "pki")
    pem = ca.issue("proxy")
    worker = ca.issue("epd-worker")
    keys = tmp_path / "keys"
    keys.write_text("file-key-0004 tenant-f\n")
    tls = {"ca": str(ca.pem.cert), "cert": str(worker.cert), "key": str(worker.key)}
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"cluster": {"tls": tls}}))
    cluster = Up(
        "--model", str(tiny_checkpoint), "--api-key", "argv-key-0005", "--api-key-file",
        str(keys), "--tls-cert", str(pem.cert), "--tls-key", str(pem.key), "--config", str(config),
    )  # fmt: skip
    try:
        cluster.wait_serving()
        assert f"https://127.0.0.1:{cluster.http_port}" in "".join(cluster.stdout)
        children = psutil.Process(cluster.proc.pid).children(recursive=True)
        proxy = next(p for p in children if "proxy" in p.cmdline())
        proxy_env = Path(f"/proc/{proxy.pid}/environ").read_bytes().decode().split("\0")
        secrets = {
            "argv-key-0005",
            "file-key-0004",
            *(e.partition("=")[2] for e in proxy_env if e.startswith("EPD_CLUSTER_SECRET=")),
            *(e.partition("=")[2] for e in proxy_env if e.startswith("EPD_CONNECTOR_PASSWORD=")),
        }
        assert len(secrets) == 4  # the generated cluster secret and Redis password are there
        config_file = None
        for child in children:
            argv = " ".join(child.cmdline())
            assert not any(s in argv for s in secrets), argv
            if "--config" in child.cmdline():
                config_file = Path(child.cmdline()[child.cmdline().index("--config") + 1])
        text = config_file.read_text()
        assert not any(s in text for s in secrets)
        # The workers (SERVING, so the launcher's mTLS health checks passed) refuse plaintext.
        lm = next(c for c in children if "lm" in c.cmdline())
        lm_address = lm.cmdline()[lm.cmdline().index("--listen") + 1]
        assert health_status(lm_address, timeout=3) == "UNREACHABLE"
        mtls = load_config(config_file).cluster.tls
        assert health_status(lm_address, timeout=3, tls=mtls) == "SERVING"
        # The embedded Redis (its process title is "valkey-server 127.0.0.1:PORT"): a password
        # and bounded memory with LRU eviction.
        valkey = next(p for p in children if "valkey-server" in " ".join(p.cmdline()))
        port = int(" ".join(valkey.cmdline()).rpartition(":")[2].split()[0])
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        password = next(e for e in proxy_env if e.startswith("EPD_CONNECTOR_PASSWORD="))
        client = redis.Redis(host="127.0.0.1", port=port, password=password.partition("=")[2])
        assert int(client.config_get("maxmemory")["maxmemory"]) > 0
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        client.close()

        def generate(*extra: str) -> subprocess.CompletedProcess:
            argv = epd_command(
                "generate", "Hi", "--target", f"localhost:{cluster.grpc_port}",
                "--max-tokens", "2", "--tls-ca", str(ca.pem.cert), *extra,
            )  # fmt: skip
            return subprocess.run(argv, capture_output=True, text=True, timeout=120)

        assert "UNAUTHENTICATED" in generate().stderr
        key_file = tmp_path / "client-key"
        key_file.write_text("file-key-0004\n")
        done = generate("--api-key-file", str(key_file))
        assert done.returncode == 0, done.stderr
    finally:
        cluster.proc.send_signal(2)
        cluster.proc.wait(60)


async def _realtime_first_event(secure, key: str | None, as_browser: bool = False) -> dict:
    """The first event of a realtime socket; a browser's key rides on a subprotocol."""
    context = ssl.create_default_context(cafile=str(secure.ca.pem.cert))
    headers = {"Authorization": f"Bearer {key}"} if key and not as_browser else None
    protocols = ["realtime", f"openai-insecure-api-key.{key}"] if as_browser else None
    url = f"wss://localhost:{secure.http_port}/v1/realtime"
    async with connect(url, ssl=context, additional_headers=headers, subprotocols=protocols) as ws:
        assert ws.subprotocol == ("realtime" if as_browser else None)  # never the key's
        return json.loads(await ws.recv())


def test_realtime_websocket_needs_a_key(secure):
    for key, words in ((None, "API key is required"), ("not-a-key", "not valid")):
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(_realtime_first_event(secure, key))
        assert refused.value.response.status_code == 401
        assert words in refused.value.response.body.decode()
    # A browser offers its key as a subprotocol: a wrong one is refused the same way.
    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(_realtime_first_event(secure, "not-a-key", as_browser=True))
    assert refused.value.response.status_code == 401
    # With a key the socket opens (this image model then refuses realtime audio itself).
    for as_browser in (False, True):
        event = asyncio.run(_realtime_first_event(secure, KEY_B, as_browser))
        assert event["type"] == "error" and event["code"] == "failed_precondition", event
        assert "does not take realtime audio" in event["error"]
