"""The LM worker's memory plan (lm_worker/memory_plan.py): its arithmetic and refusals on given
figures, `epd up`'s split of one GPU between encoders and LM workers, and the plan a real
engine makes on the CPU from host memory and its own profiling step."""

from __future__ import annotations

import logging

import pytest

from common.config import ClusterConfig, ConfigError, EncoderConfig, LMConfig
from epd.launcher import LaunchError, split_gpu_memory
from lm_worker.memory_plan import (
    CPU_KV_CACHE_BYTES,
    DeviceMemory,
    GiB,
    MemoryPlanError,
    Usage,
    plan_kv_cache,
)
from tests.lm_helpers import make_engine, run, three_cases

# A 7B-like LM in bf16: 28 layers x 2 x 16 tokens x 4 KV heads x 128 x 2 bytes per block.
BLOCK = 28 * 2 * 16 * 4 * 128 * 2


def plan(memory: DeviceMemory, usage: Usage, **kw):
    args = dict(
        utilization=0.9,
        reserved=0.0,
        kv_cache_bytes=0,
        block_bytes=BLOCK,
        block_size=16,
        max_model_len=32768,
        explicit_len=False,
    )
    return plan_kv_cache("cuda", memory, usage, **{**args, **kw})


def test_the_kv_cache_gets_the_share_less_weights_activations_and_graphs():
    usage = Usage(weights=16 * GiB, activations=3 * GiB, graphs=GiB // 2)
    p = plan(DeviceMemory(total=80 * GiB, free=62 * GiB), usage, reserved=0.1)
    share = int(80 * GiB * 0.8)
    assert p.share == share
    assert p.bound == "share"
    assert p.num_blocks == (share - usage.total) // BLOCK
    assert share - usage.total - BLOCK < p.kv_bytes <= share - usage.total
    assert p.kv_tokens == (p.num_blocks - 1) * 16
    assert p.full_requests == (p.num_blocks - 1) // (32768 // 16)
    assert p.max_model_len == 32768
    for figure in ("weights 16.00 GiB", "activations 3.00 GiB", "graphs 0.50 GiB", "share"):
        assert figure in p.summary()


def test_memory_another_process_holds_bounds_the_cache_by_what_is_free():
    usage = Usage(weights=16 * GiB, activations=2 * GiB, graphs=0)
    # 30 GiB held elsewhere: 80 - 16 (weights) - 30 = 34 free.
    p = plan(DeviceMemory(total=80 * GiB, free=34 * GiB), usage)
    assert p.bound == "free"
    assert p.num_blocks == (32 * GiB) // BLOCK


def test_an_explicit_size_is_kept_and_refused_when_not_free():
    usage = Usage(weights=16 * GiB, activations=2 * GiB, graphs=GiB)
    p = plan(DeviceMemory(80 * GiB, 60 * GiB), usage, kv_cache_bytes=10 * GiB)
    assert (p.num_blocks, p.bound) == (10 * GiB // BLOCK, "lm.kv_cache_bytes")
    with pytest.raises(MemoryPlanError, match=r"lm.kv_cache_bytes 58.00 GiB .* leaves 57.00 GiB"):
        plan(DeviceMemory(80 * GiB, 60 * GiB), usage, kv_cache_bytes=58 * GiB)


def test_not_even_one_request_of_an_explicit_context_is_refused_with_the_numbers():
    usage = Usage(weights=60 * GiB, activations=8 * GiB, graphs=GiB)
    # 10 GiB free less 9 GiB of activations and graphs: 1 GiB, 1170 blocks of 896 KiB, 18704
    # tokens < 32768.
    with pytest.raises(MemoryPlanError) as refused:
        plan(DeviceMemory(80 * GiB, 10 * GiB), usage, explicit_len=True)
    message = str(refused.value)
    assert "not even one request fits" in message
    assert "max_model_len 32768 needs 2049 KV blocks" in message
    for figure in ("weights 60.00 GiB", "activations 8.00 GiB", "graphs 1.00 GiB"):
        assert figure in message
    assert "lower lm.max_model_len" in message


def test_a_default_context_is_cut_to_what_fits(caplog):
    usage = Usage(weights=60 * GiB, activations=8 * GiB, graphs=GiB)
    with caplog.at_level(logging.WARNING, logger="lm_worker.memory_plan"):
        p = plan(DeviceMemory(80 * GiB, 10 * GiB), usage)
    assert p.max_model_len == p.kv_tokens == (GiB // BLOCK - 1) * 16 < 32768
    assert "less than the model's context 32768" in caplog.text
    # Nothing left at all: refused even for a default context.
    with pytest.raises(MemoryPlanError, match="free memory on the device"):
        plan(DeviceMemory(80 * GiB, 11 * GiB), Usage(72 * GiB, 0, 0))


def test_a_cpu_plan_uses_host_memory_and_keeps_the_cpu_default():
    usage = Usage(weights=GiB, activations=GiB // 4, graphs=0)
    host = DeviceMemory(total=64 * GiB, free=40 * GiB)
    p = plan_kv_cache(
        "cpu", host, usage, utilization=0.9, reserved=0.0, kv_cache_bytes=0,
        block_bytes=BLOCK, block_size=16, max_model_len=8192, explicit_len=False,
    )  # fmt: skip
    assert (p.kv_bytes // BLOCK, p.bound) == (CPU_KV_CACHE_BYTES // BLOCK, "cpu default")
    # A host with less than the default free: what is free is the bound.
    small = DeviceMemory(total=4 * GiB, free=1 * GiB)
    p = plan_kv_cache(
        "cpu", small, usage, utilization=0.9, reserved=0.0, kv_cache_bytes=0,
        block_bytes=BLOCK, block_size=16, max_model_len=2048, explicit_len=True,
    )  # fmt: skip
    assert p.bound == "free" and p.kv_bytes <= GiB * 3 // 4


def test_epd_up_splits_one_gpu_by_configuration():
    config = ClusterConfig(encoder=EncoderConfig(gpu_memory_utilization=0.15))
    one = split_gpu_memory(config, encoders=1, lm_workers=1)
    assert one.lm.gpu_memory_reserved == pytest.approx(0.15)
    # Two encoders and a prefill and a decode worker: (0.9 - 0.3) / 2 = 0.3 each.
    two = split_gpu_memory(config, encoders=2, lm_workers=2)
    assert two.lm.gpu_memory_utilization - two.lm.gpu_memory_reserved == pytest.approx(0.3)
    with pytest.raises(LaunchError, match=r"6 encoder\(s\) .* leaves them"):
        split_gpu_memory(config, encoders=6, lm_workers=1)


def test_the_fractions_are_checked():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        LMConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EncoderConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="nothing would be left"):
        LMConfig(gpu_memory_utilization=0.5, gpu_memory_reserved=0.5)


def test_an_engine_plans_its_kv_cache_from_its_profiling_step(tiny_checkpoint, caplog):
    """The automatic size on the CPU: the plan's log has the measured figures and the cache
    is the CPU default (this host has more than that free)."""
    with caplog.at_level(logging.INFO, logger="lm_worker.loader"):
        engine = make_engine(tiny_checkpoint, kv_cache_bytes=0, max_model_len=512)
    line = next(r.getMessage() for r in caplog.records if "memory plan" in r.getMessage())
    assert "set by cpu default" in line
    kv = engine.runner.attention.kv_cache
    assert CPU_KV_CACHE_BYTES - kv.nbytes < kv.nbytes // kv.shape[2]  # within a block
    assert engine.max_model_len == 512
    # A share of host memory too small for the weights and activations: refused, by number.
    with pytest.raises(MemoryPlanError, match=r"not even one request fits.*weights"):
        make_engine(
            tiny_checkpoint, kv_cache_bytes=0, max_model_len=512, gpu_memory_utilization=1e-9
        )


def test_the_engine_runs_on_the_planned_cache(tiny_checkpoint, tiny_ref):
    """Text and image prompts on a planned (automatic) cache give the reference's tokens."""
    engine = make_engine(tiny_checkpoint, kv_cache_bytes=0, max_model_len=256)
    cases = three_cases(tiny_ref)
    out = run(engine, *cases.values())
    for name, c in cases.items():
        assert out[name].token_ids == c.expected, name
