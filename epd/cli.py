"""The `epd` command line.

epd up                      a whole cluster on this machine (embedded Redis by default)
epd proxy|encoder|lm        one role, as compose and Kubernetes run them
epd generate PROMPT         a client: streams the answer from a running cluster
epd config                  print the effective configuration, or the EPD_ variables
epd health ADDRESS          ask a role's grpc.health.v1: exit 0 when SERVING (container checks)
epd make-model OUT          write a random checkpoint (Hugging Face layout) for tests / benchmarks
epd train-demo OUT          train the built-in model (a tiny Qwen2.5-VL that sees shapes)
epd scene OUT.png           draw a picture to ask the built-in model about
epd scene-eval              the built-in model's accuracy on held-out scenes, through a cluster
epd tower-probe             how well the built-in model's vision tower tells the shapes' kinds
epd train-speech OUT        train the built-in speech model (a tiny Voxtral Realtime)
epd say OUT.wav             speak a sentence of the speech model's world (espeak-ng)
epd speech-eval             the speech model's word accuracy on held-out sentences (a cluster)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from common.config import (
    ENV_REGISTRY,
    REDACTED,
    ClusterConfig,
    ConfigError,
    config_to_dict,
    load_config,
)
from epd import demo

ROLE_MAINS: dict[str, str] = {
    "proxy": "proxy.server",
    "encoder": "encoder_worker.server",
    "lm": "lm_worker.server",
}


def _config_from_args(args: argparse.Namespace, overrides: dict[str, Any]) -> ClusterConfig:
    return load_config(args.config, {k: v for k, v in overrides.items() if v is not None})


def up_config(args: argparse.Namespace) -> ClusterConfig:
    """`epd up`'s config: the file's, with the flags over it. `--api-key` keys reach the proxy
    through its environment (secret_env), not its argv; `--api-key-file` is handed on as
    proxy.api_keys_file, which the proxy reads itself, tenants included (`KEY [TENANT]`)."""
    from proxy.auth import read_keys_file

    overrides = {
        "model.path": args.model,
        "proxy.grpc_port": args.grpc_port,
        "proxy.http_port": args.http_port,
        "proxy.tls_cert": args.tls_cert,
        "proxy.tls_key": args.tls_key,
        "connector.url": args.redis_url,
        "connector.mode": "cluster" if args.redis_cluster else None,
        "lm.tensor_parallel_size": args.tp,
    }
    config = _config_from_args(args, overrides)
    if args.api_key_file:
        read_keys_file(args.api_key_file)  # a bad file fails here, not in the proxy
        path = os.path.abspath(args.api_key_file)  # the proxy runs in another directory
        given = config.proxy.api_keys_file
        if given is not None and os.path.abspath(given) != path:
            raise ConfigError(
                "--api-key-file",
                f"proxy.api_keys_file is already {given!r}: give one keys file, not two",
            )
        overrides["proxy.api_keys_file"] = path
    if args.api_key:
        overrides["proxy.api_keys"] = [*config.proxy.api_keys, *args.api_key]
    return _config_from_args(args, overrides)


def cmd_up(args: argparse.Namespace) -> int:
    from common.log import setup_logging
    from connector import redact_url
    from epd.launcher import LaunchError, LocalCluster, parse_encoders, run_cluster

    if args.redis_url and redact_url(args.redis_url) != args.redis_url:
        raise ConfigError(
            "--redis-url",
            "holds a password, which would show in the process list: give the URL without it "
            "and the password in EPD_CONNECTOR_PASSWORD or connector.password_file",
        )
    config = up_config(args)
    setup_logging("epd-up", config.log_level)
    count, auto = parse_encoders(args.encoders, config)
    try:
        cluster = LocalCluster(
            config,
            num_encoders=count,
            encoders_auto=auto,
            num_lm_workers=(
                args.lm_workers if args.lm_workers is not None else 0 if args.prefill_workers else 1
            ),
            num_prefill_workers=args.prefill_workers,
            num_decode_workers=args.decode_workers,
            host=args.host,
            startup_timeout=args.startup_timeout,
            max_restarts=args.max_restarts,
        )
    except LaunchError as e:
        print(f"epd up: {e}", file=sys.stderr)
        return 2
    return run_cluster(cluster)


def _role_command(role: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from common import tracing
        from common.log import setup_logging

        section = {"encoder": "encoder", "lm": "lm"}.get(role)
        overrides = {f"{section}.listen": args.listen} if section else {}
        config = _config_from_args(args, overrides)
        config.check_role(role)
        setup_logging(args.name or role, config.log_level)
        tracing.setup(role, args.name or role, config.tracing.otlp_endpoint)
        try:
            return importlib.import_module(ROLE_MAINS[role]).main(config, args.name or role)
        finally:
            tracing.shutdown()  # what is left in the exporter's queue goes out

    return run


def cmd_generate(args: argparse.Namespace) -> int:
    from epd.client import run_generate

    return run_generate(args)


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    if args.env:
        for setting in ENV_REGISTRY.values():
            current = os.environ.get(setting.name)
            shown = REDACTED if setting.secret else current
            note = f"  (set: {shown})" if current is not None else ""
            print(f"{setting.name:<40} {setting.help}{note}")
        return 0
    print(yaml.safe_dump(config_to_dict(_config_from_args(args, {})), sort_keys=False), end="")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from pathlib import Path

    import grpc

    from common.health import channel_status, health_status

    config = _config_from_args(args, {})
    try:
        if args.tls_ca:  # the proxy's client port over TLS
            options = [("grpc.ssl_target_name_override", args.tls_server_name)]
            credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())
            with grpc.secure_channel(
                args.address, credentials, options=options if args.tls_server_name else []
            ) as channel:
                status = channel_status(channel, args.service, args.timeout)
        else:
            status = health_status(args.address, args.service, args.timeout, config.cluster.tls)
    except grpc.RpcError as e:  # e.g. NOT_FOUND: the server does not know --service
        status = e.code().name
    print(status)
    return 0 if status == "SERVING" else 1


def cmd_make_model(args: argparse.Namespace) -> int:
    import time

    from models.testing import make_checkpoint

    start = time.monotonic()
    try:
        out = make_checkpoint(args.out, args.arch, args.size, args.seed, device=args.device)
    except (FileExistsError, ValueError) as e:
        print(f"epd make-model: {e}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - start
    print(f"wrote {args.arch} {args.size} (seed {args.seed}) to {out} in {elapsed:.1f}s")
    return 0


BENCH_MODULES = (
    "epd.bench.connector",
    "epd.bench.encoder",
    "epd.bench.lm",
    "epd.bench.proxy",
    "epd.bench.realtime",
    "epd.bench.soak",
    "epd.bench.serve",
    "epd.bench.pd",
    "epd.bench.structured",
)


def build_parser(with_benches: bool = True, with_models: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start a whole cluster on this machine")
    up.add_argument("--config", help="cluster YAML file (defaults fill in the rest)")
    up.add_argument("--model", help="checkpoint directory (Hugging Face layout)")
    up.add_argument("--grpc-port", type=int, help="proxy gRPC port (default 50051)")
    up.add_argument("--http-port", type=int, help="proxy HTTP port (default 8000)")
    up.add_argument(
        "--encoders",
        default="1",
        help="encoder workers (default 1), or auto[:MIN:MAX]: as many as the proxy's encoder "
        "planner asks for (bounds default to proxy.encoders_min / encoders_max)",
    )
    up.add_argument(
        "--lm-workers",
        type=int,
        help="LM workers doing prefill and decode (default 1; 0 with the split below)",
    )
    up.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="LM workers in the prefill role (with --decode-workers: the prefill / decode split)",
    )
    up.add_argument("--decode-workers", type=int, default=0, help="LM workers in the decode role")
    up.add_argument(
        "--tp",
        type=int,
        help="each LM worker as this many processes, one per GPU, holding a shard of the LM "
        "each (lm.tensor_parallel_size; default 1)",
    )
    up.add_argument(
        "--redis-url",
        help="use this Redis instead of starting the embedded one (no password in it: "
        "EPD_CONNECTOR_PASSWORD or connector.password_file)",
    )
    up.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the Redis is a Redis Cluster (--redis-url names any node; without a URL, "
        "a 3-master cluster of embedded servers)",
    )
    up.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this API key (repeatable; it reaches the roles through their "
        "environment; --api-key-file or EPD_PROXY_API_KEYS keep it out of the process list)",
    )
    up.add_argument("--api-key-file", help="API keys, one per line (KEY [TENANT])")
    up.add_argument("--tls-cert", help="serve clients over TLS with this certificate (PEM)")
    up.add_argument("--tls-key", help="the key of --tls-cert (PEM)")
    up.add_argument("--host", default="127.0.0.1", help="proxy bind address (default 127.0.0.1)")
    up.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for SERVING"
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="deaths of a role (or the embedded Redis) within 5 minutes before it is backed "
        "off (restarted 16 s, 32 s, ... up to 5 min later); a kind of role whose replicas all "
        "die before SERVING more than this many restarts in a row stops the cluster (default 5)",
    )
    up.set_defaults(func=cmd_up)

    for role, help_text in (
        ("proxy", "run the proxy (gRPC Inference + HTTP API)"),
        ("encoder", "run one encoder worker"),
        ("lm", "run one LM worker"),
    ):
        p = sub.add_parser(role, help=help_text)
        p.add_argument("--config", help="cluster YAML file")
        p.add_argument("--name", help="name in logs and metrics (default: the role)")
        if role != "proxy":
            p.add_argument("--listen", help=f"override {role}.listen (host:port)")
        p.set_defaults(func=_role_command(role))

    gen = sub.add_parser("generate", help="send one request to a running cluster")
    gen.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    gen.add_argument("--target", default="127.0.0.1:50051", help="proxy gRPC address")
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument(
        "--video", action="append", default=[], help="MP4 / WebM / MKV / MOV file (repeatable)"
    )
    gen.add_argument("--audio", action="append", default=[], help="WAV file (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send PROMPT as-is, no chat template")
    gen.add_argument("--model", default="", help="model name (default: the served one)")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (the default): greedy; the API samples at 1 when a request leaves it unset",
    )
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--api-key", help="API key (EPD_API_KEY or --api-key-file keep it hidden)")
    gen.add_argument("--api-key-file", help="file holding the API key")
    gen.add_argument("--tls", action="store_true", help="TLS, checked against the system's CAs")
    gen.add_argument("--tls-ca", help="TLS, checked against this CA certificate (PEM)")
    gen.add_argument("--tls-server-name", help="the name to expect in the proxy's certificate")
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object: text, token ids, timings"
    )
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object last")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    if with_benches:  # they import torch: only for `epd bench ...` (health checks stay fast)
        for module in BENCH_MODULES:
            importlib.import_module(module).add_parser(benches)

    cfg = sub.add_parser("config", help="print the effective configuration")
    cfg.add_argument("--config", help="cluster YAML file")
    cfg.add_argument("--env", action="store_true", help="list the EPD_ environment variables")
    cfg.set_defaults(func=cmd_config)

    health = sub.add_parser(
        "health", help="check a role's gRPC health (exit 0 when SERVING, 1 otherwise)"
    )
    health.add_argument("address", help="host:port of the role's gRPC server")
    health.add_argument(
        "--config", help="cluster YAML file: its cluster.tls (or EPD_CLUSTER_TLS_*) for mTLS"
    )
    health.add_argument("--service", default="", help="service name (default: the server's)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    health.add_argument(
        "--tls-ca", help="TLS (no client certificate), checked against this CA: the proxy's port"
    )
    health.add_argument("--tls-server-name", help="the name to expect in the certificate")
    health.set_defaults(func=cmd_health)

    mk = sub.add_parser("make-model", help="write a random checkpoint (tests, benchmarks)")
    mk.add_argument("out", help="output directory (created; must be empty)")
    archs = None  # another command runs: no need (make_checkpoint checks the name too)
    if with_models:  # models imports torch: only for `epd make-model ...`
        from models.registry import ARCH_NAMES

        archs = sorted(ARCH_NAMES)
    mk.add_argument("--arch", choices=archs, default="qwen2_5_vl")
    mk.add_argument(
        "--size",
        choices=["tiny", "small", "3b", "7b"],
        default="tiny",
        help="3b / 7b: Qwen2.5-VL-3B's / -7B's shapes in bf16 (qwen2_vl, qwen2_5_vl)",
    )
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: fast)")
    mk.set_defaults(func=cmd_make_model)

    demo.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    parser = build_parser(with_benches=command == "bench", with_models=command == "make-model")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"epd {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
