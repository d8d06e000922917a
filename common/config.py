"""The cluster configuration: one YAML file parsed into frozen, typed objects.

Every role reads the same file and takes its own section. Precedence, lowest first: the defaults
below, the YAML file, `EPD_*` environment variables, command-line flags. Anything wrong (an
unknown key, a wrong type, an impossible value, a combination we do not support) is refused at
start-up by `ConfigError`, whose message names the key and says what to change.

Environment overrides go through one registry derived from these dataclasses: the key
`connector.url` is `EPD_CONNECTOR_URL`, `proxy.grpc_port` is `EPD_PROXY_GRPC_PORT`, and so on
(`epd config --env` lists them). An `EPD_` variable that is not in the registry is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import yaml

ENV_PREFIX = "EPD_"

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "bfloat16", "float16", "float32"]
LogLevel = Literal["debug", "info", "warning", "error"]
# The CPU linear kernels an LM worker can run (lm_worker/cpu_kernels.py): ROW+BATCH, the kernel
# of one-row products and the one of batches; a name alone is that kernel for both where it
# runs batches (mkl and gemv run one row only: F.linear for batches).
CPULinearKernel = Literal[
    "linear",
    "onednn",
    "mkl",
    "gemv",
    "linear+onednn",
    "onednn+linear",
    "mkl+onednn",
    "gemv+onednn",
]


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class ByteSize(int):
    """A size in bytes; the YAML may say 1073741824, "1GiB", "512MiB" or "64kB"."""

    @classmethod
    def parse(cls, value: str) -> ByteSize:
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number) :]
        if unit not in _SIZE_UNITS:
            raise ValueError(value)
        return cls(int(float(number) * _SIZE_UNITS[unit]))


# Marks a setting that holds a secret: `epd config` shows it redacted, dump_config leaves it out
# (`epd up` hands it to its children through the environment), and it is never logged.
SECRET = {"secret": True}
REDACTED = "<redacted>"

_ONE_GIB = ByteSize(1 << 30)
_32_MIB = ByteSize(32 << 20)
_256_MIB = ByteSize(256 << 20)
# Under CUDA graphs the torch decode attention reads max_model_len keys per sequence (static
# shapes); the Triton kernel used on CUDA reads only the blocks in use, but the cap stays until
# long contexts are measured on a GPU: without an explicit lm.max_model_len it applies.
DEFAULT_MAX_MODEL_LEN = 8192
_AUTO_SIZE = ByteSize(0)


class ConfigError(ValueError):
    """A configuration value that cannot be used. `key` is the dotted path to it."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


def parse_address(value: str, key: str = "") -> tuple[str, int]:
    """'host:port' or '[v6::addr]:port' -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(key, f"expected an address 'host:port', got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port_num = int(port)
    if not 0 < port_num < 65536:
        raise ConfigError(key, f"port must be in 1..65535, got {port_num} in {value!r}")
    return host, port_num


def advertised_address(listen: str, advertise: str | None) -> str:
    """The address others dial: `advertise` if set, else `listen` with a wildcard host
    replaced by this host's primary address."""
    if advertise:
        return advertise
    host, port = parse_address(listen)
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{port}"


def _check_port(key: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(key, f"must be a port in 1..65535, got {port}")


def _check_metrics_port(metrics_port: int, listen: str) -> None:
    if metrics_port:
        _check_port("metrics_port", metrics_port)
        if metrics_port == parse_address(listen)[1]:
            raise ConfigError(
                "metrics_port", f"is the gRPC port of listen ({listen}): give /metrics another port"
            )


def _check_fraction(key: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(key, f"must be in (0, 1], got {value}")


def _check_positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    # A checkpoint directory in the Hugging Face layout. None: the built-in small model.
    path: str | None = None
    # The served model name (the API's `model`). None: the directory's name.
    name: str | None = None
    # Compute and embedding dtype, the same on every role (it is part of the cache keys).
    # auto: the dtype the checkpoint was saved in.
    dtype: DType = "auto"

    def __post_init__(self):
        if self.name is not None and not self.name.strip():
            raise ConfigError("name", "must not be empty (leave it out to use the directory name)")

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return Path(self.path).name if self.path else "epd-builtin"


@dataclass(frozen=True)
class ConnectorConfig:
    # redis://[user:password@]host:port/db, rediss:// for TLS. None: `epd up` starts the
    # embedded server; the single-role commands need it set.
    url: str | None = None
    # standalone: one Redis (or a primary at a fixed address). cluster: Redis Cluster / Valkey
    # cluster (or a managed cluster-mode endpoint): url names any node, the rest is discovered.
    mode: Literal["standalone", "cluster"] = "standalone"
    # Prefix of every key, so several clusters can share one Redis.
    namespace: str = "epd"
    # Lifetime of a published embedding. Eviction before then is normal: a miss re-encodes.
    ttl_seconds: int = 3600
    # How long a role waits at start-up for Redis to answer before it gives up.
    startup_wait_seconds: float = 60.0
    # Per-command socket timeout, and retries (jittered exponential backoff) for transient
    # errors before an operation fails with the URL and the cause.
    op_timeout_seconds: float = 5.0
    retries: int = 3
    # The most one embedding-store operation on a request's path may take, retries included.
    # A Redis that does not answer within it fails the requests that need it (UNAVAILABLE /
    # HTTP 503 naming the store) and is marked not answering: then such requests fail at once,
    # and it is PINGed every probe_interval_seconds until it answers. A restart shorter than
    # the deadline is ridden out by the retries. In cluster mode the deadline is at least
    # op_timeout_seconds x (retries + 1), so a master's failover is waited out.
    request_deadline_seconds: float = 3.0
    probe_interval_seconds: float = 0.5
    # The LM worker's in-process hot tier in front of Redis (0: off).
    local_cache_bytes: ByteSize = _ONE_GIB
    # The password of the URL's user (an ACL user, or the default user), kept out of the URL so
    # that it is in no file and no argv: EPD_CONNECTOR_PASSWORD, or a file holding it.
    password: str | None = field(default=None, metadata=SECRET)
    password_file: str | None = None
    # rediss:// only: the CA that signed the server's certificate (PEM), and a client
    # certificate and key when the server asks for one (tls-auth-clients).
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self):
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                "url", f"must start with redis://, rediss:// or unix://, got {self.url!r}"
            )
        if not self.namespace or any(c in self.namespace for c in ": {}"):
            raise ConfigError(
                "namespace",
                f"must be non-empty without ':', '{{', '}}' or spaces: {self.namespace!r}",
            )
        _check_positive("ttl_seconds", self.ttl_seconds)
        _check_positive("startup_wait_seconds", self.startup_wait_seconds)
        _check_positive("op_timeout_seconds", self.op_timeout_seconds)
        _check_positive("request_deadline_seconds", self.request_deadline_seconds)
        _check_positive("probe_interval_seconds", self.probe_interval_seconds)
        if self.retries < 0:
            raise ConfigError("retries", f"must be >= 0, got {self.retries}")
        if self.mode == "cluster" and self.url is not None:
            if self.url.startswith("unix://"):
                raise ConfigError("url", "a Redis Cluster is reached over TCP, not unix://")
            if urlsplit(self.url).path.strip("/") not in ("", "0"):
                raise ConfigError(
                    "url", f"Redis Cluster has only database 0; {self.url!r} selects another"
                )
        if self.password is not None and self.password_file is not None:
            raise ConfigError("password_file", "set password or password_file, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_key", "tls_cert and tls_key go together: set both or neither")
        tls = self.tls_ca or self.tls_cert
        if tls and self.url is not None and not self.url.startswith("rediss://"):
            raise ConfigError("tls_ca", "TLS settings need a rediss:// url")

    @property
    def redis_url(self) -> str | None:
        """The URL the roles connect with: `url` plus the password and TLS files. It lives in
        memory only; log it through connector.redact_url."""
        if self.url is None:
            return None
        parts = urlsplit(self.url)
        netloc = parts.netloc
        password = self.password
        if self.password_file is not None:
            password = read_secret_file(self.password_file, "connector.password_file")
        if password is not None:
            if parts.password is not None:
                raise ConfigError(
                    "connector.password", "the url already holds a password: give it once"
                )
            user = quote(unquote(parts.username or ""), safe="")
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:{quote(password, safe='')}@{host}"
        query = parse_qsl(parts.query)
        for key, value in (
            ("ssl_ca_certs", self.tls_ca),
            ("ssl_certfile", self.tls_cert),
            ("ssl_keyfile", self.tls_key),
        ):
            if value is not None:
                query.append((key, value))
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))

    def connector_options(self, local_tier: bool = False) -> dict[str, Any]:
        """The EC connector's constructor keywords (connector/ takes plain values, never this
        config). Only consumers (LM workers) keep a local tier."""
        assert self.url is not None, "ClusterConfig.check_role refuses a missing connector.url"
        return {
            "url": self.redis_url,
            "namespace": self.namespace,
            "ttl_seconds": self.ttl_seconds,
            "local_tier_bytes": self.local_cache_bytes if local_tier else 0,
            "op_timeout": self.op_timeout_seconds,
            "retries": self.retries,
            "mode": self.mode,
        }

    def store_options(self, local_tier: bool = False) -> dict[str, Any]:
        """The asyncio EC connector's keywords (connector/ec_async.py): `connector_options`
        and its request-path deadline and probing."""
        return {
            **self.connector_options(local_tier),
            "deadline": self.request_deadline_seconds,
            "probe_interval": self.probe_interval_seconds,
        }


@dataclass(frozen=True)
class ProxyConfig:
    # Where both APIs bind: loopback unless asked (containers set 0.0.0.0).
    host: str = "127.0.0.1"
    # Client-facing gRPC (epd.v1.Inference).
    grpc_port: int = 50051
    # OpenAI-compatible HTTP API, /health, /metrics.
    http_port: int = 8000
    # Static worker addresses ('host:port').
    encoders: tuple[str, ...] = ()
    lm_workers: tuple[str, ...] = ()
    # Requests in flight at once; past it new ones are refused (RESOURCE_EXHAUSTED / HTTP 429)
    # rather than queued without bound.
    max_pending_requests: int = 1024
    # Limits checked at the edge, before any work: an HTTP body's bytes (checked before it is
    # read), media items per request, placeholder (embedding) tokens per item, messages.
    max_body_bytes: ByteSize = _32_MIB
    max_media_items: int = 32
    max_item_tokens: int = 16384
    # Chat messages per request, and content parts over all of them (each costs templating
    # and tokenizing work that its bytes do not show).
    max_messages: int = 2048
    max_content_parts: int = 4096
    # Deadline of a request that brings none (gRPC callers' own deadlines propagate).
    request_timeout_seconds: float = 600.0
    # Realtime audio sessions (Inference.Realtime, GET /v1/realtime): at most this many open
    # at once (more: RESOURCE_EXHAUSTED / an `error` event), each at most this long in audio,
    # and ended when no audio or commit came for `realtime_idle_timeout_seconds`; one chunk
    # of audio holds at most `realtime_max_chunk_seconds` (clients send tens of ms).
    realtime_max_sessions: int = 256
    realtime_max_session_seconds: float = 600.0
    realtime_idle_timeout_seconds: float = 30.0
    realtime_max_chunk_seconds: float = 10.0
    # Attempts per encode or LM call that fails before any output (backoff with jitter).
    retries: int = 3
    # A worker's circuit opens after this many consecutive failures, and lets one request
    # through again after the cooldown.
    circuit_failures: int = 3
    circuit_cooldown_seconds: float = 5.0
    # How often the proxy asks each worker for its load.
    load_poll_seconds: float = 0.5
    # Prefix-cache affinity: an LM call goes to the worker holding the longest prefix of its
    # prompt (prefill, decode and whole requests alike) unless that worker's queued tokens
    # exceed those of the worker load alone would pick by more than the prefix it holds, or
    # than the margin when that is less. The proxy
    # remembers up to `prefix_affinity_blocks` block hashes of prompts it saw complete, each
    # with the workers that hold it (least recently recorded dropped first; 0: off; about 190
    # bytes each: the default, a million tokens of 16-token blocks, takes 12 MB).
    prefix_affinity_blocks: int = 65536
    prefix_affinity_margin_tokens: int = 2048
    # On SIGTERM: how long requests in flight may take to finish before the proxy exits.
    drain_timeout_seconds: float = 30.0
    # Single flight across proxies: a proxy encoding an item keeps a "being encoded" mark on it
    # in Redis, refreshed every third of this; another proxy waits for the item instead of
    # encoding it, and takes over when a mark lapses (its proxy died) before the item appears.
    encode_mark_ttl_seconds: float = 3.0
    # The encoder planner (proxy/planner.py): the encoder count demand needs, exported as
    # epd_encoders_desired (what `epd up --encoders auto` and a Kubernetes HPA act on). Encoders
    # are sized to run at `encoder_target_utilisation` and to clear their queues within
    # `encoder_wait_slo_seconds`; the count rises at once and falls only after demand stayed
    # lower for `encoder_scale_down_seconds`; it stays within [encoders_min, encoders_max].
    encoder_wait_slo_seconds: float = 1.0
    encoder_target_utilisation: float = 0.7
    encoder_scale_down_seconds: float = 60.0
    encoders_min: int = 1
    encoders_max: int = 8
    # API keys. With none (here, in EPD_PROXY_API_KEYS, comma-separated, or in the file) the
    # APIs are open. The file holds one key per line, optionally followed by its tenant's name
    # (keys of one tenant share cached media given by uuid); '#' starts a comment.
    api_keys: tuple[str, ...] = field(default=(), metadata=SECRET)
    api_keys_file: str | None = None
    # /metrics and /dashboard answer without a key when true (/health always does).
    metrics_public: bool = False
    dashboard_public: bool = False
    # TLS for clients: HTTPS and gRPC over TLS with this certificate chain and key (PEM).
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_key", "tls_cert and tls_key go together: set both or neither")
        for i, key in enumerate(self.api_keys):
            if not key.strip() or any(c.isspace() for c in key):
                raise ConfigError(f"api_keys[{i}]", "must be non-empty, without spaces")
        _check_positive("drain_timeout_seconds", self.drain_timeout_seconds)
        _check_positive("encode_mark_ttl_seconds", self.encode_mark_ttl_seconds)
        _check_positive("encoder_wait_slo_seconds", self.encoder_wait_slo_seconds)
        _check_positive("encoder_scale_down_seconds", self.encoder_scale_down_seconds)
        if not 0 < self.encoder_target_utilisation <= 1:
            raise ConfigError(
                "encoder_target_utilisation",
                f"must be in (0, 1], got {self.encoder_target_utilisation}",
            )
        if not 1 <= self.encoders_min <= self.encoders_max:
            raise ConfigError(
                "encoders_min",
                f"({self.encoders_min}) must be at least 1 and at most encoders_max "
                f"({self.encoders_max})",
            )
        _check_positive("request_timeout_seconds", self.request_timeout_seconds)
        _check_positive("circuit_cooldown_seconds", self.circuit_cooldown_seconds)
        _check_positive("load_poll_seconds", self.load_poll_seconds)
        _check_positive("realtime_max_session_seconds", self.realtime_max_session_seconds)
        _check_positive("realtime_idle_timeout_seconds", self.realtime_idle_timeout_seconds)
        _check_positive("realtime_max_chunk_seconds", self.realtime_max_chunk_seconds)
        for key in (
            "max_pending_requests",
            "realtime_max_sessions",
            "retries",
            "circuit_failures",
            "max_body_bytes",
            "max_media_items",
            "max_item_tokens",
            "max_messages",
            "max_content_parts",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("prefix_affinity_blocks", "prefix_affinity_margin_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        _check_port("grpc_port", self.grpc_port)
        _check_port("http_port", self.http_port)
        if self.grpc_port == self.http_port:
            raise ConfigError(
                "http_port",
                f"grpc_port and http_port are both {self.http_port}: give them different ports",
            )
        for name in ("encoders", "lm_workers"):
            addresses = getattr(self, name)
            for i, address in enumerate(addresses):
                parse_address(address, f"{name}[{i}]")
            if len(set(addresses)) != len(addresses):
                dup = next(a for a in addresses if addresses.count(a) > 1)
                raise ConfigError(name, f"lists {dup} more than once")


@dataclass(frozen=True)
class EncoderConfig:
    # Where the encoder's gRPC server binds, and the address it registers for the proxy to
    # dial (default: listen, with a wildcard host replaced by this host's address).
    listen: str = "127.0.0.1:50061"
    advertise: str | None = None
    device: Device = "auto"
    # On a GPU: the fraction of its memory the encoder may hold (torch's allocator is capped
    # there); an LM worker that `epd up` starts on the same GPU leaves it out of its share.
    gpu_memory_utilization: float = 0.1
    # On SIGTERM: how long in-flight encodes may take to finish before the worker exits.
    drain_timeout_seconds: float = 30.0
    # Cross-request batching: one tower forward takes up to this many items and this many
    # output embeddings, counted before EVS pruning (an item larger than the token budget runs
    # alone). 1 item: no batching.
    max_batch_items: int = 32
    max_batch_tokens: int = 8192
    # How long an idle tower waits for more items before it runs a batch that is not full
    # (0: at once; under load, batches fill while the tower is busy anyway).
    batch_wait_ms: float = 0.0
    # Threads that decode and preprocess media (0: one per CPU core, at most 8).
    preprocess_workers: int = 0
    # Images (and video frames) above this many pixels, read from the header, are refused
    # before decoding (decompression-bomb protection).
    max_image_pixels: int = 64 * 1024 * 1024
    # Videos: at most this many frames sampled (or sent) per video, and containers at most this
    # long; longer ones are refused (the proxy reads both from the header).
    max_video_frames: int = 768
    max_video_seconds: float = 3600.0
    # Efficient video sampling (EVS): the fraction of a video's tokens pruned after the tower
    # (fewer prompt tokens, less prefill; the most repetitive tokens go). None: the model's
    # config.json `video_pruning_rate`; 0: off. Every role reads it: it sets placeholder counts
    # and is part of the embeddings' fingerprint.
    video_pruning_rate: float | None = None
    # Audio clips longer than this, read from the header, are refused before decoding.
    max_audio_seconds: float = 600.0
    # Realtime sessions (EncodeStream) one encoder worker keeps open at once; more are
    # refused with RESOURCE_EXHAUSTED.
    max_streams: int = 64
    # Prometheus /metrics over HTTP on this port, on the listen host (0: off).
    metrics_port: int = 0

    def __post_init__(self):
        parse_address(self.listen, "listen")
        if self.advertise is not None:
            parse_address(self.advertise, "advertise")
        _check_positive("drain_timeout_seconds", self.drain_timeout_seconds)
        _check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        _check_positive("max_audio_seconds", self.max_audio_seconds)
        _check_positive("max_streams", self.max_streams)
        for key in ("max_batch_items", "max_batch_tokens", "max_image_pixels", "max_video_frames"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        _check_positive("max_video_seconds", self.max_video_seconds)
        q = self.video_pruning_rate
        if q is not None and not 0 <= q < 1:
            raise ConfigError("video_pruning_rate", f"must be in [0, 1), got {q}")
        if self.batch_wait_ms < 0:
            raise ConfigError("batch_wait_ms", f"must be >= 0, got {self.batch_wait_ms}")
        if self.preprocess_workers < 0:
            raise ConfigError(
                "preprocess_workers", f"must be >= 0 (0: auto), got {self.preprocess_workers}"
            )
        _check_metrics_port(self.metrics_port, self.listen)

    @property
    def address(self) -> str:
        """Where the proxy dials this worker (what it registers)."""
        return advertised_address(self.listen, self.advertise)


@dataclass(frozen=True)
class LMConfig:
    # Where the LM worker's gRPC server binds, and the address it registers for the proxy to
    # dial (default: listen, with a wildcard host replaced by this host's address).
    listen: str = "127.0.0.1:50071"
    advertise: str | None = None
    device: Device = "auto"
    # Continuous batching: sequences per step, and the token budget per step (decodes take one
    # token each; prefills are chunked to fit what is left).
    max_num_seqs: int = 64
    # Realtime sessions one LM worker runs at once (each holds its KV while it waits for
    # audio); more are refused with RESOURCE_EXHAUSTED.
    max_realtime_sessions: int = 32
    max_num_batched_tokens: int = 2048
    # Context length; None: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # Paged KV cache: tokens per block, and the bytes for all blocks (0: auto, what the memory
    # plan leaves, lm_worker/memory_plan.py: on a GPU the worker's share of it less the weights,
    # the largest step's activations and the decode graphs, all measured at start-up; on a CPU
    # the same over host memory, at most 1 GiB).
    block_size: int = 16
    kv_cache_bytes: ByteSize = _AUTO_SIZE
    # The fraction of the device (a CPU: of host memory) the LM worker and the roles beside it
    # on the same device may hold, and the part of it other roles there declared (`epd up` sets
    # it to its local encoders' encoder.gpu_memory_utilization when they share the GPU).
    gpu_memory_utilization: float = 0.9
    gpu_memory_reserved: float = 0.0
    # One LM worker as this many processes, each holding a shard of the LM (Megatron tensor
    # parallelism, lm_worker/tensor_parallel.py): rank r on cuda:r on a GPU, gloo on a CPU.
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # Decode in CUDA graphs: auto (on with CUDA), on (CUDA required), off.
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # Largest decode batch captured; larger batches run eagerly.
    max_graph_batch_size: int = 64
    # Prefill attention on a GPU: torch (SDPA per chunk, a dense mask over a cached prefix) or
    # triton (lm_worker/triton_prefill.py: every chunk in one launch over the paged cache, no
    # mask; held to the torch path under Triton's interpreter, not yet timed on a GPU: the
    # default moves once scripts/gpu_checks.sh has). The CPU always runs torch.
    prefill_attention: Literal["torch", "triton"] = "torch"
    # The CPU's linear kernels: auto (timed at start-up over the model's own layers, the fastest
    # that matches F.linear at one row and at a decode batch, each; cached per CPU and model
    # shape), or ROW+BATCH: the one-row kernel, linear (torch's F.linear), onednn (oneDNN on
    # weights packed once), mkl (MKL's packed sgemm) or gemv (ours, lm_worker/cpu_decode.c, built
    # with the machine's C compiler on first use), and the batch kernel, linear or onednn; a
    # name alone is that kernel for both where it runs batches (mkl, gemv: F.linear for them).
    # bf16 layers take linear and gemv only.
    cpu_linear: Literal["auto", CPULinearKernel] = "auto"
    # CPU decode steps of up to 8 sequences through every decoder layer in one C call
    # (lm_worker/cpu_decode.py; its products read each weight row once for all of them): auto
    # (Qwen2 decoders in float32 or bf16, for the sequence counts where it is measured faster
    # than the torch modules at start-up), on (up to 8 sequences; an error where it cannot
    # run), off.
    cpu_fused_decode: Literal["auto", "on", "off"] = "auto"
    # Batch-invariant decoding: a request's logits do not depend on what else is in its batch,
    # how its prompt was chunked or which request cached its prefix, so a greedy or seeded
    # request gives the same tokens alone, in any batch, after a preemption or a migration.
    # On the CPU every step runs our C layers with each token's sums its own
    # (lm_worker/cpu_decode.py's InvariantForward; Qwen2-VL / Qwen2.5-VL decoders;
    # cpu_linear and cpu_fused_decode are then not used); on a GPU the products, norms and
    # attention run Triton kernels of one tiling for every batch (lm_worker/
    # triton_invariant.py). Costs throughput (`epd bench lm --batch-invariant`). Off: the
    # fastest kernels, and a request's tokens may depend on its batch (README, "Sampling").
    batch_invariant: bool = False
    # CPU: the LM's weights and KV cache on 2 MiB pages (Linux transparent huge pages, asked
    # for with madvise; lm_worker/huge_pages.py): a decode step's stream of weights reads
    # faster with fewer TLB misses. The weights are copied once at start-up out of the
    # checkpoint's file mapping (so workers on one machine no longer share those pages), and
    # the KV cache's memory is committed 2 MiB at a time. Where the kernel grants none, the
    # log says so.
    cpu_huge_pages: bool = True
    # How long a request may wait for its embeddings to appear in the cache.
    embedding_timeout_seconds: float = 120.0
    # Admit a request at once and prefill its text up to the first item whose embedding has
    # not arrived while that item is encoded (off: admit it once all its embeddings are in).
    overlap_encode_prefill: bool = True
    # A step running longer than this counts as stuck: the worker says NOT_SERVING and ends its
    # streams with UNAVAILABLE, so the proxy moves them to another worker.
    step_timeout_seconds: float = 30.0
    # On SIGTERM: how long running requests may take to finish before the worker exits.
    drain_timeout_seconds: float = 60.0
    # Prometheus /metrics over HTTP on this port, on the listen host (0: off).
    metrics_port: int = 0
    # What the proxy sends this worker: both (prefill and decode, one worker per request),
    # prefill (a request's prompt KV and first token, handed over) or decode (the rest of a
    # handed-over request, its KV pulled from the KV tier). Any role serves any request.
    role: Literal["both", "prefill", "decode"] = "both"
    # The KV tier: shared (KV blocks in the connector's Redis, keyed by the block-hash chain:
    # handovers, prefix hits across workers, re-prefills after a migration), direct (shared,
    # and a handover's blocks go straight from the prefill worker to the decode worker chosen
    # for it, over one kept TCP connection per pair), none, or auto (shared for the prefill
    # and decode roles, none for both).
    kv_connector: Literal["auto", "none", "shared", "direct"] = "auto"
    # direct: the port of this worker's KV receiver, on the listen host (0: any free port; the
    # worker reports it to the proxy), and the bytes its inbox holds (oldest dropped first).
    kv_port: int = 0
    kv_inbox_bytes: ByteSize = _256_MIB
    # direct: send a handover's blocks layer by layer as the prefill computes them, overlapped
    # with the layers still to run (off: each step's blocks, all layers, after its forward).
    kv_send_layerwise: bool = True
    # Lifetime of a KV block in the tier (the memory bound is Redis's maxmemory, as for the
    # embeddings).
    kv_ttl_seconds: int = 600

    @property
    def kv_tier(self) -> str:
        """The KV connector in use: direct, shared or none."""
        if self.kv_connector == "auto":
            return "none" if self.role == "both" else "shared"
        return self.kv_connector

    def __post_init__(self):
        parse_address(self.listen, "listen")
        if self.role != "both" and self.kv_connector == "none":
            raise ConfigError(
                "kv_connector", f"a {self.role} worker hands KV over: set shared (or auto)"
            )
        _check_positive("kv_ttl_seconds", self.kv_ttl_seconds)
        if not 0 <= self.kv_port < 65536:
            raise ConfigError("kv_port", f"must be in 0..65535, got {self.kv_port}")
        if self.advertise is not None:
            parse_address(self.advertise, "advertise")
        for key in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_graph_batch_size",
            "max_realtime_sessions",
            "tensor_parallel_size",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token per decode step",
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        _check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 <= self.gpu_memory_reserved < self.gpu_memory_utilization:
            raise ConfigError(
                "gpu_memory_reserved",
                f"must be in [0, gpu_memory_utilization {self.gpu_memory_utilization}), got "
                f"{self.gpu_memory_reserved}: nothing would be left for the LM worker",
            )
        _check_positive("embedding_timeout_seconds", self.embedding_timeout_seconds)
        _check_positive("step_timeout_seconds", self.step_timeout_seconds)
        _check_positive("drain_timeout_seconds", self.drain_timeout_seconds)
        _check_metrics_port(self.metrics_port, self.listen)

    @property
    def address(self) -> str:
        """Where the proxy dials this worker (what it registers)."""
        return advertised_address(self.listen, self.advertise)

    def context_length(self, max_position_embeddings: int) -> int:
        """The context LM workers serve with this config (before any cut to the KV cache):
        lm.max_model_len, else the model's, capped at DEFAULT_MAX_MODEL_LEN."""
        return self.max_model_len or min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


@dataclass(frozen=True)
class RegistryConfig:
    # Workers announce themselves in Redis and the proxy routes to them without a restart
    # (static addresses in proxy.encoders / proxy.lm_workers are used as well).
    enabled: bool = True
    heartbeat_seconds: float = 1.0
    # A worker whose last heartbeat is older than this is taken out of rotation.
    ttl_seconds: float = 3.0

    def __post_init__(self):
        _check_positive("heartbeat_seconds", self.heartbeat_seconds)
        if self.ttl_seconds <= self.heartbeat_seconds:
            raise ConfigError(
                "ttl_seconds",
                f"({self.ttl_seconds}) must be longer than heartbeat_seconds "
                f"({self.heartbeat_seconds}), or live workers drop out between heartbeats",
            )


@dataclass(frozen=True)
class ClusterTLSConfig:
    # mTLS between the proxy and the workers (PEM files). Each process has its own cert / key,
    # signed by `ca`: workers accept only clients presenting a certificate `ca` signed, and
    # the proxy (and `epd health`, the launcher) checks the workers' certificates against it.
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    # The name checked in a worker's certificate, whatever address is dialled (workers are
    # dialled by IP from the registry); None: the dialled host itself.
    server_name: str | None = None

    def __post_init__(self):
        given = [self.ca is not None, self.cert is not None, self.key is not None]
        if any(given) and not all(given):
            raise ConfigError("ca", "mTLS needs all three of ca, cert and key (or none)")

    @property
    def enabled(self) -> bool:
        return self.ca is not None


@dataclass(frozen=True)
class SecurityConfig:
    # The cluster's shared secret: the proxy signs each media hash it hands an encoder with it,
    # and encoders store embeddings only under hashes so signed; without tls, workers answer
    # only calls carrying its token (common/cluster_auth.py). The same value on the proxy and
    # every worker: EPD_CLUSTER_SECRET, or a file holding it (`epd up` makes one).
    secret: str | None = field(default=None, metadata=SECRET)
    secret_file: str | None = None
    tls: ClusterTLSConfig = field(default_factory=ClusterTLSConfig)

    def __post_init__(self):
        if self.secret is not None and self.secret_file is not None:
            raise ConfigError("secret_file", "set secret or secret_file, not both")
        if self.secret is not None and len(self.secret) < 16:
            raise ConfigError("secret", "must be at least 16 characters (32 random bytes, hex)")

    def signing_key(self) -> bytes:
        """The shared secret's bytes; ConfigError when none is set."""
        if self.secret_file is not None:
            value = read_secret_file(self.secret_file, "cluster.secret_file")
        elif self.secret is not None:
            value = self.secret
        else:
            raise ConfigError(
                "cluster.secret",
                f"is not set: give the proxy and every encoder the same random value in "
                f"{ENV_PREFIX}CLUSTER_SECRET or cluster.secret_file (e.g. `openssl rand -hex 32`)",
            )
        if len(value) < 16:
            raise ConfigError("cluster.secret", "must be at least 16 characters")
        return value.encode()


def read_secret_file(path: str, key: str) -> str:
    """A secret kept in a file (a mounted Kubernetes / compose secret): its first line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None
    value = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not value:
        raise ConfigError(key, f"{path} is empty")
    return value


@dataclass(frozen=True)
class TracingConfig:
    # OpenTelemetry traces (common/tracing.py) go to this OTLP gRPC endpoint, e.g.
    # 'http://collector:4317'; None: the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT, and with neither set tracing is off (and costs nothing).
    otlp_endpoint: str | None = None


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    lm: LMConfig = field(default_factory=LMConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cluster: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    log_level: LogLevel = "info"

    def heartbeat_options(self, kind: Literal["encoder", "lm"]) -> dict[str, Any] | None:
        """connector.registry.Heartbeat's keywords for a worker of `kind`; None with the
        registry off."""
        if not self.registry.enabled:
            return None
        return {
            "url": self.connector.redis_url,
            "namespace": self.connector.namespace,
            "role": kind,
            "address": getattr(self, kind).address,
            "interval": self.registry.heartbeat_seconds,
            "mode": self.connector.mode,
        }

    def check_role(self, role: str) -> None:
        """Refuse, before anything starts, what `role` cannot run with."""
        if self.connector.url is None:
            raise ConfigError(
                "connector.url",
                f"is not set, and the {role} needs Redis: set connector.url in the config file "
                f"or {ENV_PREFIX}CONNECTOR_URL (only `epd up` starts an embedded server)",
            )
        if self.model.path is not None and not (Path(self.model.path) / "config.json").is_file():
            raise ConfigError(
                "model.path",
                f"{self.model.path!r} is not a checkpoint directory (no config.json in it)",
            )
        if role in ("proxy", "encoder"):
            self.cluster.signing_key()
        self.connector.redis_url  # noqa: B018 (reads the password file: a bad one fails here)


# --------------------------------------------------------------------------------------------
# Building typed objects from plain data (YAML, environment, flags)
# --------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _coerce(tp: Any, value: Any, key: str, from_env: bool) -> Any:
    """Check `value` against the annotation `tp`; parse it from a string when from_env."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (from_env and value == ""):
            if type(None) in get_args(tp):
                return None
            raise ConfigError(key, "must be set")
        assert len(options) == 1, f"unsupported annotation {tp}"
        return _coerce(options[0], value, key, from_env)
    if value is None:
        raise ConfigError(key, "must be set (null is not allowed here)")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = get_args(tp)
        if from_env and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {_describe(value)}")
        return tuple(_coerce(item_tp, v, f"{key}[{i}]", from_env) for i, v in enumerate(value))
    if tp is ByteSize:
        if isinstance(value, str):
            try:
                return ByteSize.parse(value)
            except ValueError:
                raise ConfigError(
                    key, f"expected a size like 512MiB or 2GB, got {value!r}"
                ) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(key, f"expected a size in bytes, got {_describe(value)}")
        return ByteSize(value)
    if tp is bool:
        if from_env and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if from_env and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(key, f"expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if from_env and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_describe(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise AssertionError(f"unsupported annotation {tp} at {key}")


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of settings, got {_describe(data)}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(_join(prefix, str(key)), f"unknown key{hint}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], _join(prefix, name), from_env=False)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(prefix) if prefix else e from None


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# --------------------------------------------------------------------------------------------
# The environment registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvSetting:
    name: str  # EPD_...
    key: str  # dotted config key, or "" for a process setting
    type: Any
    help: str
    secret: bool = False


def _config_env_settings(cls: type = ClusterConfig, path: tuple[str, ...] = ()) -> list[EnvSetting]:
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _config_env_settings(tp, (*path, f.name))
        else:
            key = ".".join((*path, f.name))
            name = ENV_PREFIX + "_".join((*path, f.name)).upper()
            out.append(EnvSetting(name, key, tp, key, bool(f.metadata.get("secret"))))
    return out


# Settings of the process rather than of the cluster.
PROCESS_ENV_SETTINGS = [
    EnvSetting(
        ENV_PREFIX + "CACHE_DIR",
        "",
        str,
        "where epd keeps what it writes for itself (the built-in model); default ~/.cache/epd",
    ),
    EnvSetting(ENV_PREFIX + "API_KEY", "", str, "the API key `epd generate` sends", secret=True),
    EnvSetting(
        ENV_PREFIX + "CPU_VECTOR_BITS",
        "",
        str,
        "our C kernels' vectors, 256 or 512 bits (default: the faster, measured at start-up)",
    ),
]

ENV_REGISTRY: dict[str, EnvSetting] = {
    s.name: s for s in _config_env_settings() + PROCESS_ENV_SETTINGS
}
assert len(ENV_REGISTRY) == len(_config_env_settings()) + len(PROCESS_ENV_SETTINGS), (
    "two settings map to one EPD_ variable"
)


def _check_env(environ: Mapping[str, str]) -> None:
    for name in environ:
        if name.startswith(ENV_PREFIX) and name not in ENV_REGISTRY:
            close = difflib.get_close_matches(name, list(ENV_REGISTRY), n=1)
            hint = f"; did you mean {close[0]}?" if close else " (`epd config --env` lists them)"
            raise ConfigError(name, f"is not a known setting{hint}")


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config keys that EPD_* variables set, parsed to their types."""
    _check_env(environ)
    out = {}
    for name, setting in ENV_REGISTRY.items():
        if setting.key and name in environ:
            out[setting.key] = _coerce(setting.type, environ[name], name, from_env=True)
    return out


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    value = environ.get(ENV_PREFIX + "CACHE_DIR")
    return Path(value) if value else Path.home() / ".cache" / "epd"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _set_path(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parents[: i + 1]), "expected a mapping of settings")
        node = child
    node[leaf] = value


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ClusterConfig:
    """Read the YAML file (optional), apply EPD_* variables, then `overrides` (dotted keys)."""
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError("", f"cannot read config file {path}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError("", f"{path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError("", f"{path} must hold a mapping of sections, got {_describe(data)}")
    for key, value in {**env_overrides(environ), **(overrides or {})}.items():
        _set_path(data, key, value)
    return _build(ClusterConfig, data)


def _secret_fields(config: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every secret setting of `config`."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _secret_fields(value, (*path, f.name))
        elif f.metadata.get("secret"):
            yield ".".join((*path, f.name)), value


def config_to_dict(config: Any, secrets: Literal["redact", "drop"] = "redact") -> dict:
    """The plain-data form of a config object (YAML-ready: tuples become lists). Secrets that
    are set are shown as REDACTED, or left out with secrets="drop"."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, ByteSize):
            return int(v)
        return v

    data = plain(dataclasses.asdict(config))
    for key, value in _secret_fields(config):
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        if secrets == "drop":
            del node[leaf]
        elif value:
            node[leaf] = [REDACTED] * len(value) if isinstance(value, tuple) else REDACTED
    return data


def secret_env(config: ClusterConfig) -> dict[str, str]:
    """The EPD_ variables that carry `config`'s secrets to a child process (dump_config leaves
    them out of the file it writes)."""
    out = {}
    for key, value in _secret_fields(config):
        if value:
            name = ENV_PREFIX + key.replace(".", "_").upper()
            out[name] = ",".join(value) if isinstance(value, tuple) else str(value)
    return out


def dump_config(config: ClusterConfig, path: str | os.PathLike) -> None:
    """The config as YAML, without its secrets (see secret_env)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config, "drop"), sort_keys=False))


__all__ = [
    "ENV_REGISTRY",
    "ByteSize",
    "ClusterConfig",
    "ConfigError",
    "ConnectorConfig",
    "EncoderConfig",
    "LMConfig",
    "ModelConfig",
    "ProxyConfig",
    "RegistryConfig",
    "SecurityConfig",
    "advertised_address",
    "cache_dir",
    "config_to_dict",
    "dump_config",
    "load_config",
    "parse_address",
    "read_secret_file",
    "secret_env",
]
