"""The LM worker's memory plan: how many KV blocks the device holds once the weights, the
largest step's activations and the decode graphs have their share, as vLLM and SGLang size
theirs: load the weights, run a profiling step at the largest prefill the scheduler admits
(and the largest decode batch the graphs capture), measure the peak, and give the KV cache
what the worker's share of the device leaves.

    share  = total x (lm.gpu_memory_utilization - lm.gpu_memory_reserved)
    kv     = share - weights - activations - graphs          (never more than is free now)

`lm.gpu_memory_reserved` is what other roles on the same device declared (`epd up` sets it to
its local encoders' `encoder.gpu_memory_utilization` when they share the GPU), so the split
follows the configuration, not the order the roles start in. On a CPU the same arithmetic runs
over host memory (total: MemTotal; free: MemAvailable), and the automatic KV cache is at most
`CPU_KV_CACHE_BYTES`, as vLLM's CPU backend keeps a fixed default: a CPU host runs other work.

`plan_kv_cache` is the arithmetic alone (tests hold it to numbers); `measure_*` take the
figures on the device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GiB = 2**30
CPU_KV_CACHE_BYTES = 1 * GiB


class MemoryPlanError(RuntimeError):
    """Not even one request fits (or an explicit size does not): the message has the numbers."""


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # the GPU's memory, or the host's
    free: int  # free now, with the weights loaded and the profiling step's peak released


@dataclass(frozen=True)
class Usage:
    """What the worker holds besides its KV cache."""

    weights: int
    activations: int  # the profiling step's peak above the weights
    graphs: int  # the decode graphs' memory pool (0 without graphs)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.graphs


@dataclass(frozen=True)
class MemoryPlan:
    device: str  # "cuda" or "cpu"
    memory: DeviceMemory
    share: int  # the worker's share of the device: total x (utilization - reserved)
    usage: Usage
    block_bytes: int
    block_size: int
    num_blocks: int  # including the null block
    max_model_len: int  # the context, cut to what the cache holds where it was the default
    bound: str  # what set the KV size: "share", "free", "cpu default" or "lm.kv_cache_bytes"

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_tokens(self) -> int:
        """The longest request that fits, alone (block 0 is the null block)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def full_requests(self) -> int:
        """Requests of max_model_len the cache holds at once."""
        return (self.num_blocks - 1) // -(-self.max_model_len // self.block_size)

    def summary(self) -> str:
        u = self.usage
        return (
            f"{self.device} memory {_gib(self.memory.total)} (free {_gib(self.memory.free)}), "
            f"this worker's share {_gib(self.share)}: weights {_gib(u.weights)}, activations "
            f"{_gib(u.activations)}, graphs {_gib(u.graphs)}, KV cache {_gib(self.kv_bytes)} "
            f"({self.num_blocks} blocks of {self.block_size} tokens, set by {self.bound}): "
            f"{self.kv_tokens} tokens, the longest request; {self.full_requests} of "
            f"max_model_len {self.max_model_len} at once"
        )


def plan_kv_cache(
    device: str,
    memory: DeviceMemory,
    usage: Usage,
    *,
    utilization: float,
    reserved: float,
    kv_cache_bytes: int,  # 0: auto
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    explicit_len: bool,  # max_model_len was configured (else: the model's, cut to fit)
) -> MemoryPlan:
    """The KV cache's size. Refuses (MemoryPlanError, with the breakdown) when an explicit
    `kv_cache_bytes` is more than is free, or when not even one request of an explicit
    `max_model_len` fits; a default context is cut to what fits, and the log says so. (A
    request longer than the cache could never finish: it would preempt itself forever and
    block every request queued behind it.)"""
    share = int(memory.total * (utilization - reserved))
    bound = "lm.kv_cache_bytes"
    if kv_cache_bytes:
        budget = kv_cache_bytes
        room = memory.free - usage.activations - usage.graphs
        if budget > room:
            raise MemoryPlanError(
                f"lm.kv_cache_bytes {_gib(budget)} is more than the {device} has free for it: "
                f"{_gib(memory.free)} free after the weights ({_gib(usage.weights)}), less "
                f"activations {_gib(usage.activations)} and graphs {_gib(usage.graphs)}, leaves "
                f"{_gib(room)}"
            )
    else:
        from_share = share - usage.total
        from_free = memory.free - usage.activations - usage.graphs
        budget, bound = min((from_share, "share"), (from_free, "free"))
        if device == "cpu" and budget > CPU_KV_CACHE_BYTES:
            budget, bound = CPU_KV_CACHE_BYTES, "cpu default"
    num_blocks = max(budget, 0) // block_bytes
    per_request = -(-max_model_len // block_size) + 1  # and the null block
    plan = MemoryPlan(
        device, memory, share, usage, block_bytes, block_size, num_blocks, max_model_len, bound
    )
    if num_blocks >= per_request:
        return plan
    why = (
        f"a request of max_model_len {max_model_len} needs {per_request} KV blocks "
        f"({_gib(per_request * block_bytes)}); {plan.summary()}"
    )
    if explicit_len or num_blocks < 2:
        fix = "lower lm.max_model_len" if explicit_len else "free memory on the device"
        raise MemoryPlanError(
            f"not even one request fits: {why}. Raise lm.gpu_memory_utilization (or "
            f"lm.kv_cache_bytes), {fix}, or use a device with more memory"
        )
    plan = dataclasses.replace(plan, max_model_len=plan.kv_tokens)
    logger.warning(
        "the KV cache holds %d tokens, less than the model's context %d: the context is %d (%s)",
        plan.kv_tokens,
        max_model_len,
        plan.kv_tokens,
        why,
    )
    return plan


# -- measuring ---------------------------------------------------------------------------------


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free bytes: the GPU's (torch's cached blocks released first), or the host's."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, free)
    info = _meminfo()
    return DeviceMemory(info["MemTotal"], info["MemAvailable"])


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            rows = (line.split() for line in f)
            return {r[0].rstrip(":"): int(r[1]) * 1024 for r in rows if len(r) >= 2}
    except OSError:  # not Linux: the page counts
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES")
        return {"MemTotal": pages * size, "MemAvailable": free * size}


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class PeakMeter:
    """Bytes a piece of work raised the memory's peak by, above what was in use when it
    started: torch's allocator peak on a GPU; on a CPU the process's resident high-water mark
    (an upper bound where an earlier peak was higher: the kernel keeps only the highest)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = _resident_bytes()
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.bytes = max(peak - self._start, 0)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
