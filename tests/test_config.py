"""Configuration: each kind of bad input is refused at start-up with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config import (
    ENV_REGISTRY,
    ClusterConfig,
    ConfigError,
    ConnectorConfig,
    ModelConfig,
    load_config,
)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def load(tmp_path, data, environ=None, overrides=None) -> ClusterConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, overrides, environ=environ or {})


def refused(tmp_path, data, environ=None, overrides=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data, environ, overrides)
    return info.value


def test_defaults_are_valid():
    config = load_config(None, environ={})
    assert config.proxy.grpc_port == 50051
    assert config.connector.url is None
    assert config.model.served_name == "epd-builtin"


def test_full_file_round_trips(tmp_path):
    config = load(
        tmp_path,
        {
            "model": {"path": "/models/Qwen2.5-VL-3B-Instruct", "dtype": "bfloat16"},
            "connector": {"url": "rediss://epd:secret@redis.example:6380/0", "ttl_seconds": 600},
            "proxy": {"encoders": ["enc-0:50061", "[::1]:50062"], "lm_workers": ["lm-0:50071"]},
            "encoder": {"listen": "0.0.0.0:50061", "device": "cuda"},
            "lm": {"drain_timeout_seconds": 5},
            "log_level": "debug",
        },
    )
    assert config.model.served_name == "Qwen2.5-VL-3B-Instruct"
    assert config.connector.url.startswith("rediss://")
    assert config.proxy.encoders == ("enc-0:50061", "[::1]:50062")
    assert config.lm.drain_timeout_seconds == 5.0
    with pytest.raises(AttributeError):
        config.proxy.grpc_port = 1  # frozen


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"conector": {}}, "conector", "did you mean 'connector'"),
        ({"proxy": {"grpc_prot": 1}}, "proxy.grpc_prot", "did you mean 'grpc_port'"),
        ({"connector": {"ttl_seconds": "1h"}}, "connector.ttl_seconds", "expected an integer"),
        ({"proxy": {"grpc_port": True}}, "proxy.grpc_port", "expected an integer"),
        ({"proxy": {"encoders": "a:1"}}, "proxy.encoders", "expected a list"),
        ({"proxy": 7}, "proxy", "expected a mapping"),
        ({"encoder": {"device": "tpu"}}, "encoder.device", "one of auto, cpu, cuda"),
        ({"model": {"dtype": None}}, "model.dtype", "must be set"),
        ({"log_level": "loud"}, "log_level", "one of debug, info"),
    ],
)
def test_wrong_keys_and_types(tmp_path, data, key, words):
    error = refused(tmp_path, data)
    assert error.key == key
    assert words in str(error)


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"connector": {"ttl_seconds": 0}}, "connector.ttl_seconds", "must be > 0"),
        ({"connector": {"url": "http://x:1"}}, "connector.url", "redis://, rediss://"),
        ({"connector": {"namespace": "a:b"}}, "connector.namespace", "without ':'"),
        ({"proxy": {"http_port": 70000}}, "proxy.http_port", "1..65535"),
        ({"proxy": {"encoders": ["nohost"]}}, "proxy.encoders[0]", "'host:port'"),
        ({"proxy": {"lm_workers": ["a:1", "a:1"]}}, "proxy.lm_workers", "more than once"),
        ({"encoder": {"listen": "0.0.0.0:0"}}, "encoder.listen", "1..65535"),
        ({"lm": {"drain_timeout_seconds": -1}}, "lm.drain_timeout_seconds", "must be > 0"),
        ({"model": {"name": " "}}, "model.name", "must not be empty"),
    ],
)
def test_impossible_values(tmp_path, data, key, words):
    error = refused(tmp_path, data)
    assert error.key == key
    assert words in str(error)


def test_unsupported_combination_says_what_to_change(tmp_path):
    error = refused(tmp_path, {"proxy": {"grpc_port": 9000, "http_port": 9000}})
    assert error.key == "proxy.http_port"
    assert "give them different ports" in str(error)


def test_role_refuses_what_it_cannot_run_with(tmp_path):
    config = load_config(None, environ={})
    with pytest.raises(ConfigError, match=r"connector\.url: is not set.*EPD_CONNECTOR_URL"):
        config.check_role("encoder")
    config = ClusterConfig(
        model=ModelConfig(path=str(tmp_path)), connector=ConnectorConfig(url="redis://h:1")
    )
    with pytest.raises(ConfigError, match=r"model\.path: .*no config\.json"):
        config.check_role("lm")


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    environ = {
        "EPD_CONNECTOR_URL": "redis://env:6379/0",
        "EPD_PROXY_ENCODERS": "a:1, b:2",
        "EPD_CONNECTOR_TTL_SECONDS": "60",
        "EPD_LM_DEVICE": "cpu",
        "EPD_MODEL_PATH": "",
    }
    config = load(
        tmp_path,
        {"connector": {"url": "redis://file:6379/0", "ttl_seconds": 5}, "model": {"path": "/m"}},
        environ=environ,
        overrides={"connector.ttl_seconds": 7},
    )
    assert config.connector.url == "redis://env:6379/0"
    assert config.proxy.encoders == ("a:1", "b:2")
    assert config.connector.ttl_seconds == 7
    assert config.lm.device == "cpu"
    assert config.model.path is None


def test_environment_errors_name_the_variable(tmp_path):
    error = refused(tmp_path, {}, environ={"EPD_PROXY_GRPC_PORT": "fifty"})
    assert error.key == "EPD_PROXY_GRPC_PORT"
    assert "expected an integer" in str(error)
    error = refused(tmp_path, {}, environ={"EPD_CONECTOR_URL": "redis://x:1"})
    assert "did you mean EPD_CONNECTOR_URL" in str(error)


def test_registry_covers_every_leaf_setting():
    keys = {s.key for s in ENV_REGISTRY.values() if s.key}
    assert "connector.url" in keys and "proxy.grpc_port" in keys and "log_level" in keys
    assert "EPD_CACHE_DIR" in ENV_REGISTRY


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path, environ={})
    path.write_text("proxy: {grpc_port: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path, environ={})


@pytest.mark.parametrize("example", sorted(DEPLOY.rglob("cluster*.yaml")), ids=str)
def test_example_configs_load(example):
    config = load_config(example, environ={})
    assert config.connector.url is not None


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("connector: {ttl_seconds: -5}\n")
    result = subprocess.run(
        [sys.executable, "-m", "epd", "config", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "connector.ttl_seconds: must be > 0, got -5" in result.stderr
