"""Tensor-parallel LM workers on the CPU (gloo): the shards add up to the model, and an engine
of 2 (or 4) ranks gives the same greedy tokens as the reference for text, one and two images,
chunked prefill, MoE experts split across the ranks, and a realtime transcription."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import torch

from lm_worker.attention import PagedAttention
from models import load_family
from models.parallel import TensorParallel, tensor_parallel
from models.testing import ReferenceModel, make_checkpoint
from tests.lm_helpers import case, make_engine, png, run, three_cases

ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tp") / request.param, request.param)
    return path, ReferenceModel(path)


def shard(path, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters as it loads them (no collective runs while loading)."""
    family = load_family(path)
    attention = PagedAttention(16, family.text.head_dim)
    with tensor_parallel(TensorParallel(rank, size, group=None)):
        lm = family.language_model(attention, torch.float32, torch.device("cpu"))
    return dict(lm.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_shard_and_the_shards_add_up(model, size):
    """Every parameter is split along one dimension (concatenated back it is the whole one:
    the vocabulary's rows, heads, MLP width, experts) or replicated (norms); k / v are
    replicated by head when there are fewer KV heads (2) than ranks (4)."""
    path, _ = model
    whole = shard(path, 0, 1)
    ranks = [shard(path, r, size) for r in range(size)]
    kv_heads = load_family(path).text.num_kv_heads
    for name, full in whole.items():
        parts = [r[name] for r in ranks]
        if all(p.shape == full.shape for p in parts):
            if name.endswith("o_proj.bias") or name.endswith("down_proj.bias"):
                continue  # (rank 0's alone; none in these models)
            assert all(torch.equal(p, full) for p in parts), name
            continue
        dim = next(d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d])
        if (".k_proj." in name or ".v_proj." in name) and kv_heads < size:
            # Replicated: rank r holds KV head r // (size / kv_heads).
            heads = full.chunk(kv_heads)
            for r, p in enumerate(parts):
                assert torch.equal(p, heads[r * kv_heads // size]), name
            continue
        joined = torch.cat(parts, dim=dim).narrow(dim, 0, full.shape[dim])
        assert torch.equal(joined, full), name
    total = sum(p.numel() for p in whole.values())
    sharded = sum(p.numel() for r in ranks for p in r.values())
    assert sharded >= total  # replicated norms (and KV heads at 4 ranks) counted per rank


@pytest.mark.timeout(300)
def test_two_ranks_give_the_reference_tokens(model):
    """Text, one image and two images, each as the reference decodes them, on 2 ranks."""
    path, ref = model
    cases = three_cases(ref)
    engine = make_engine(path, tensor_parallel_size=2)
    try:
        assert engine.runner.ranks is not None and engine.runner.ranks.tp.size == 2
        # Decode steps in the fused C layers, all-reducing through the group (not with the
        # MoE's experts split: the C routes over all of them).
        assert (engine.runner.fused is not None) == ("moe" not in path.name)
        out = run(engine, *cases.values())
    finally:
        engine.stop()
    for name, c in cases.items():
        assert out[name].token_ids == c.expected, name


@pytest.mark.timeout(300)
def test_chunked_prefill_and_replicated_kv_heads_on_four_ranks(tmp_path):
    """4 ranks over 2 KV heads (each replicated on two ranks), prompts prefilled 16 tokens a
    step: an image prompt's chunks cut its embedding rows."""
    path = make_checkpoint(tmp_path / "ckpt", "qwen2_5_vl")
    ref = ReferenceModel(path)
    c = case(ref, "image", "Describe this picture in detail please", [png(112, 84)])
    text = case(ref, "text", "Once upon a time there was a long prompt " * 3)
    engine = make_engine(path, tensor_parallel_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        out = run(engine, c, text)
    finally:
        engine.stop()
    assert out["image"].token_ids == c.expected
    assert out["text"].token_ids == text.expected


@pytest.mark.timeout(300)
def test_a_realtime_transcription_on_two_ranks(tmp_path):
    """Voxtral Realtime: each decode step's audio rows reach both ranks; the transcription
    equals transformers' generate."""
    from lm_worker.request import Request
    from models import MMFeature, SamplingParams
    from models.voxtral_realtime import audio as audio_io
    from tests.lm_helpers import Collected
    from tests.voxtral_helpers import hf_model, hf_processor, speech_like

    path = make_checkpoint(tmp_path / "vx", "voxtral_realtime")
    family = load_family(path)
    encoder = family.load_encoder(torch.float32, torch.device("cpu"))
    samples = speech_like(1.4, seed=3)
    hf = hf_processor(path)(samples, return_tensors="pt", sampling_rate=16000)
    with torch.no_grad():
        expected = hf_model(path).generate(**hf)[0].tolist()
    padded = audio_io.pad_for_transcription(samples, family.streaming)
    embeds = encoder.model(encoder.log_mel(torch.from_numpy(padded)))
    prompt, offset, length = family.transcription_prompt(embeds.shape[0])
    request = Request(
        "a",
        prompt,
        SamplingParams(temperature=0.0),
        [MMFeature("hash-a", offset, length, modality="audio")],
    )
    engine = make_engine(path, block_size=8, tensor_parallel_size=2)
    sink = Collected()
    try:
        engine.validate(request)
        engine.add_request(request, sink, {"hash-a": embeds})
        engine.run_to_completion()
    finally:
        engine.stop()
    assert prompt + sink.token_ids == expected


def tp_ranks_of(pid: int) -> list[int]:
    """The pids of an LM worker's other ranks (its children running lm_worker.tp_rank)."""
    return [
        child.pid
        for child in psutil.Process(pid).children()
        if "lm_worker.tp_rank" in child.cmdline()
    ]


@pytest.mark.timeout(400)
def test_a_rank_killed_mid_stream_fails_over_with_no_lost_stream(tmp_path, tiny_checkpoint):
    """Two LM workers of 2 ranks each; kill -9 of rank 1 of the busier one once every stream
    has output: that worker exits whole at once, its streams move to the other worker, and
    12 of 12 complete with all their tokens."""
    from tests.cluster_helpers import Cluster
    from tests.test_chaos import MAX_TOKENS, STREAMS, busiest_lm, run_load, text_load

    cluster = Cluster(
        tmp_path,
        tiny_checkpoint,
        encoders=1,
        lms=2,
        lm={"tensor_parallel_size": 2, "max_num_seqs": 16, "embedding_timeout_seconds": 20},
        proxy={"retries": 4},
    )
    killed = []
    try:
        for name in ("lm-0", "lm-1"):
            assert len(tp_ranks_of(cluster.roles[name].child.proc.pid)) == 1, name

        def kill_a_rank() -> None:
            killed.append(busiest_lm(cluster))
            (rank,) = tp_ranks_of(cluster.roles[killed[0]].child.proc.pid)
            os.kill(rank, signal.SIGKILL)

        report = run_load(cluster, "kill -9 tp rank", text_load(), kill_a_rank, when_tokens=4)
        assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])
        assert report.migrated >= 1, report.line()
        assert all(len(r.tokens) == MAX_TOKENS for r in report.results)
        # The worker went down whole: rank 0 exited, its code non-zero.
        assert cluster.roles[killed[0]].child.proc.wait(10) != 0
    finally:
        cluster.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("prefill_tp, decode_tp, connector", [(2, 1, "shared"), (1, 2, "direct")])
def test_prefill_and_decode_workers_of_different_sizes_exchange_kv(
    tmp_path, tiny_checkpoint, tiny_ref, prefill_tp, decode_tp, connector
):
    """A block goes between workers with all its KV heads, gathered from the prefill worker's
    ranks and handed to the decode worker's in their shares: 2 ranks hand over to 1 through
    the Redis tier, 1 to 2 straight to the decode worker; text, one and two images (chunked
    on the prefill worker) equal the reference."""
    from tests.cluster_helpers import Cluster, image_bytes
    from tests.test_pd_cluster import expected, wait_roles

    sizes = (prefill_tp, decode_tp)
    cluster = Cluster(
        tmp_path,
        tiny_checkpoint,
        encoders=1,
        lms=2,
        lm_roles=("prefill", "decode"),
        lm_env=tuple({"EPD_LM_TENSOR_PARALLEL_SIZE": str(n)} for n in sizes),
        lm={
            "block_size": 8,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 16,
            "kv_connector": connector,
        },
    )
    try:
        wait_roles(cluster, count=2)
        for name, n in zip(("lm-0", "lm-1"), sizes, strict=True):
            assert len(tp_ranks_of(cluster.roles[name].child.proc.pid)) == n - 1, name
        for text, images in (
            ("Tell me a story about the sea", ()),
            ("What is in this picture?", (image_bytes(64, 48, 7),)),
            ("Compare the two", (image_bytes(56, 56, 8), image_bytes(48, 80, 9))),
        ):
            tokens, last = cluster.generate(text, images, max_tokens=6)
            assert tokens == expected(tiny_ref, text, images, max_tokens=6), text
            # The decode worker took the whole prompt's KV from the prefill worker.
            assert last.usage.cached_prompt_tokens == last.usage.prompt_tokens
    finally:
        cluster.stop()


def test_a_model_that_does_not_split_is_refused_by_name(model):
    path, _ = model
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 ranks"):
        shard(path, 0, 3)


def test_a_vocabulary_that_does_not_split_evenly_is_padded():
    """511 tokens over 2 ranks (a gloo group of two threads): 256 rows each, the last one's
    padding row zeros; the lookup and the logits equal the whole matrix's, the padding cut."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from common.process import free_port
    from models.parallel import VocabParallelEmbedding, VocabParallelHead

    vocab, dim = 511, 8
    full = torch.randn(vocab, dim)
    padded = torch.cat([full, torch.zeros(1, dim)])
    ids = torch.tensor([0, 255, 256, 510, 7])
    hidden = torch.randn(3, dim)
    port, results, errors = free_port(), {}, []

    def rank(r: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, r == 0, timedelta(seconds=30))
            tp = TensorParallel(r, 2, dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)))
            embed, head = VocabParallelEmbedding(tp, vocab, dim), VocabParallelHead(tp, vocab, dim)
            assert embed.weight.shape == head.weight.shape == (256, dim)
            embed.weight.data = head.weight.data = padded[r * 256 : (r + 1) * 256]
            with torch.no_grad():
                results[r] = (embed(ids), head(hidden))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rows, logits in results.values():
        torch.testing.assert_close(rows, full[ids])
        torch.testing.assert_close(logits, hidden @ full.T)
