"""Tensor-parallel LM workers: one worker, `lm.tensor_parallel_size` processes (ranks).

Rank 0 is the LM worker as always: the gRPC server, the scheduler, the block manager, the
sampler. It starts ranks 1 .. N-1 (`python -m lm_worker.tp_rank`, one per device: rank
r on cuda:r) and writes each, over its stdin, its `RankSpec`, then every step's inputs
(`StepArrays`, and the step's embedding rows: the embedding cache is read once, by rank 0).
Every rank builds the same runner on its shard of the model (models/parallel.py) in the same
order, so their collectives meet (the profiling steps, the graphs, the memory plan: every rank
takes the smallest), and runs each step's forward: the all-reduces and all-gathers inside run
on a process group of their own (gloo on CPUs, NCCL on GPUs), never torch's default group.
Only rank 0 samples; the logits are whole on every rank.

Faults: a rank whose stdin closes (rank 0 is gone) exits. A rank that dies breaks the next
collective on rank 0 (gloo sees the closed socket at once), and `Ranks.dead` names it: the LM
worker's server checks it and exits whole, so the proxy moves its streams and `epd up` starts
the worker again. A rank that hangs is caught by the group's timeout and by the engine's step
watchdog (lm.step_timeout_seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import IO

import torch
import torch.distributed as dist

from common.config import LMConfig
from common.device import resolve_device
from common.process import free_port
from connector import wire
from models import FamilyOptions, ModelFamily
from models.parallel import TensorParallel, kv_heads_of

logger = logging.getLogger(__name__)

# Collectives wait at most this long: the ranks load the model at their own pace, and a step
# that hangs meets the engine's step watchdog first.
GROUP_TIMEOUT = timedelta(minutes=10)
F_SETPIPE_SZ = 1031  # fcntl's, on Linux
PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its runner: the same settings as rank 0's."""

    lm: LMConfig
    model_path: str
    options: FamilyOptions
    dtype: torch.dtype
    store_port: int
    rank: int
    size: int
    threads: int  # torch's threads (on a CPU, the cores are shared between the ranks)

    def to_json(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "lm": dataclasses.asdict(self.lm),
            "options": dataclasses.asdict(self.options),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def from_json(cls, d: dict) -> RankSpec:
        return cls(**{
            **d,
            "lm": LMConfig(**d["lm"]),
            "options": FamilyOptions(**d["options"]),
            "dtype": getattr(torch, d["dtype"]),
        })  # fmt: skip


# -- the pipes' messages ----------------------------------------------------------------------
# One message: its header's length and its tensor count (two uint32), the header (JSON: the
# kind and every integer), then each tensor in the embedding wire format (connector/wire.py:
# float32 / float16 / bfloat16, checked), its length before it (uint64). No pickle.
_FRAME = struct.Struct("<II")
_LENGTH = struct.Struct("<Q")


def encode_message(header: dict, tensors: Sequence[torch.Tensor] = ()) -> bytes:
    head = json.dumps(header).encode()
    parts = [_FRAME.pack(len(head), len(tensors)), head]
    for t in tensors:
        blob = wire.encode(t)
        parts += [_LENGTH.pack(len(blob)), blob]
    return b"".join(parts)


def read_message(pipe: IO[bytes]) -> tuple[dict, list[torch.Tensor]]:
    """The next message (EOFError once the pipe is closed)."""
    head_bytes, count = _FRAME.unpack(_read(pipe, _FRAME.size))
    header = json.loads(_read(pipe, head_bytes))
    tensors = [wire.decode(_read(pipe, _LENGTH.unpack(_read(pipe, _LENGTH.size))[0]))
               for _ in range(count)]  # fmt: skip
    return header, tensors


def _read(pipe: IO[bytes], n: int) -> bytes:
    data = pipe.read(n)
    if len(data) != n:
        raise EOFError("the pipe closed")
    return data


def mask_to_json(is_mm_embed: torch.Tensor | None) -> dict | None:
    """A step's is_mm_embed as its length and the rows set."""
    if is_mm_embed is None:
        return None
    return {"length": is_mm_embed.shape[0], "rows": is_mm_embed.nonzero().flatten().tolist()}


def mask_from_json(d: dict | None) -> torch.Tensor | None:
    if d is None:
        return None
    mask = torch.zeros(d["length"], dtype=torch.bool)
    mask[d["rows"]] = True
    return mask


def make_group(store: dist.Store, rank: int, size: int, device: torch.device):
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)


class RankLost(BaseException):
    """Another rank of this worker is gone: no step can run again. A BaseException, so the
    engine does not take it for its batch's failure (it would end the batch's requests with an
    error, where the proxy should move them to another worker)."""


class Ranks:
    """Rank 0's handle on the other ranks: their processes and the pipe to each."""

    def __init__(self, tp: TensorParallel, procs: list[subprocess.Popen], store: dist.Store):
        self.tp = tp
        self.procs = procs
        self.store = store  # kept alive: the ranks' rendezvous
        self._closing = False

    def watch(self, on_lost: Callable[[str], None], every: float = 0.2) -> None:
        """Call `on_lost(why)` (once, from a thread of its own) when a rank exits: an LM
        worker's server exits whole then. A dead peer breaks gloo's next collective at once,
        but NCCL's would wait out its timeout: the watch does not."""

        def run() -> None:
            while not self._closing:
                why = self.dead()
                if why is not None:
                    on_lost(why)
                    return
                time.sleep(every)

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def check(self, error: BaseException) -> None:
        """After a failed step: RankLost if a rank exited (given a moment to be seen exiting:
        its socket closes before its process is reaped)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            why = self.dead()
            if why is not None:
                raise RankLost(why) from error
            time.sleep(0.05)

    def send(self, data: bytes, procs: Sequence[subprocess.Popen] | None = None) -> None:
        """A message (`encode_message`) to every other rank, or to `procs`."""
        for proc in self.procs if procs is None else procs:
            proc.stdin.write(data)
            proc.stdin.flush()

    def send_step(self, step, mm_embeds: list[torch.Tensor], is_mm_embed) -> None:
        """A step's inputs (`StepArrays`), as its forward gets them (the rows encoded once for
        all ranks)."""
        header = {"kind": "step", "step": step.to_json(), "mask": mask_to_json(is_mm_embed)}
        self.send(encode_message(header, mm_embeds))

    def receive(self, proc: subprocess.Popen) -> list[torch.Tensor]:
        """A rank's reply's tensors (RankLost when its pipe closes instead)."""
        try:
            return read_message(proc.stdout)[1]
        except (EOFError, OSError) as e:
            raise RankLost(self.dead() or "a tensor-parallel rank closed its pipe") from e

    def dead(self) -> str | None:
        """Which rank has exited, and how (None: all run)."""
        for r, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {r} exited with code {proc.returncode}"
        return None

    def close(self, timeout: float = 10.0) -> None:
        """The ranks end (their stdin closed); any still running after `timeout` is killed."""
        self._closing = True
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_ranks(lm: LMConfig, family: ModelFamily, dtype: torch.dtype) -> Ranks:
    """Ranks 1 .. N-1 started and joined to rank 0 (this process) in a new process group."""
    size = lm.tensor_parallel_size
    device = resolve_device(lm.device, "lm.device")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise RuntimeError(
            f"lm.tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} "
            "are visible"
        )
    threads = torch.get_num_threads()
    if device.type == "cpu":  # each rank a share of the cores, rank 0 (this process) too
        threads = max(threads // size, 1)
        torch.set_num_threads(threads)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, size, True, GROUP_TIMEOUT, wait_for_workers=False)
    procs = []
    for rank in range(1, size):
        proc = subprocess.Popen(
            [sys.executable, "-m", "lm_worker.tp_rank"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # its KV shards, when the KV connector asks (stderr: logs)
        )
        spec = RankSpec(lm, str(family.path), family.options, dtype, port, rank, size, threads)
        # A 1 MiB pipe (Linux's default is 64 KiB): an image's rows in far fewer writes.
        with contextlib.suppress(OSError):
            fcntl.fcntl(proc.stdin.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
        proc.stdin.write(encode_message({"kind": "spec", "spec": spec.to_json()}))
        proc.stdin.flush()
        procs.append(proc)
    try:
        group = make_group(store, 0, size, device)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    logger.info(
        "tensor parallelism: %d ranks (pids %s), %d torch threads each",
        size,
        [p.pid for p in procs],
        threads,
    )
    return Ranks(TensorParallel(0, size, group, device), procs, store)


class WholeHeadsCache:
    """The KV cache of every rank as the KV connector sees one cache: blocks with all the KV
    heads. `index_select` gathers the blocks' heads from every rank (the others reply over
    their pipes), `index_copy_` hands each rank its heads of them (before the step that reads
    them: the ranks take their messages in order). So a prefill worker of N ranks and a decode
    worker of M ranks exchange the same blocks as single-process workers do."""

    def __init__(self, cache: torch.Tensor, ranks: Ranks, num_kv_heads: int):
        self.cache = cache  # rank 0's shard: [L, 2, blocks, block_size, local kv heads, d]
        self.ranks = ranks
        size = ranks.tp.size
        self.heads = [kv_heads_of(r, size, num_kv_heads) for r in range(size)]
        self.device, self.dtype = cache.device, cache.dtype
        L, two, blocks, bs, _, d = cache.shape
        self.shape = torch.Size((L, two, blocks, bs, num_kv_heads, d))
        # The ranks whose heads, in rank order, are every head once (with replicated heads,
        # the first rank holding each).
        self.owners = [r for r in range(size) if r == 0 or self.heads[r] != self.heads[r - 1]]

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        assert dim == 2, "the KV connector selects blocks"
        owners = [self.ranks.procs[r - 1] for r in self.owners[1:]]
        self.ranks.send(encode_message({"kind": "kv_out", "ids": ids.tolist()}), owners)
        parts = [self.cache.index_select(2, ids).cpu()]
        parts += [self.ranks.receive(proc)[0] for proc in owners]
        return torch.cat(parts, dim=4).to(self.device)

    def index_copy_(self, dim: int, ids: torch.Tensor, data: torch.Tensor) -> WholeHeadsCache:
        assert dim == 2, "the KV connector copies blocks in"
        header = {"kind": "kv_in", "ids": ids.tolist()}
        for r, proc in enumerate(self.ranks.procs, start=1):
            heads = self.heads[r]
            self.ranks.send(
                encode_message(header, [data[..., heads.start : heads.stop, :]]), [proc]
            )
        heads = self.heads[0]
        self.cache.index_copy_(2, ids.to(self.device), data[..., heads.start : heads.stop, :])
        return self
