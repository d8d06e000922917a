"""EVS across processes: a cluster configured with `encoder.video_pruning_rate: 0.75`.

The proxy counts the pruned placeholders from the header; the encoder prunes and publishes the
kept embeddings with their position channels; the LM worker strips them and recomputes M-RoPE.
The expected tokens come from the same request run in-process (the proxy's request builder,
the family's encoder, an LM engine), which tests/test_video_lm.py holds against transformers.
A repeated video is held (not encoded again) and its prompt's blocks come from the prefix cache.
"""

from __future__ import annotations

import base64

import openai
import pytest
import torch

from common.config import load_config
from common.served_model import resolve_model
from lm_worker.request import Request
from models import MMFeature, SamplingParams
from proto import epd_pb2
from proxy.prepare import RequestBuilder
from proxy.validate import Limits, parse_messages
from tests.cluster_helpers import Cluster, image_bytes
from tests.lm_helpers import make_engine, run
from tests.model_helpers import make_video

MAX_TOKENS = 10
Q = 0.75


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("evs"),
        tiny_checkpoint,
        encoders=1,
        encoder={"video_pruning_rate": Q},
    )
    yield c
    c.stop()


def messages(video: bytes, image: bytes, text: str) -> list[dict]:
    def url(mime, data):
        return f"data:{mime};base64," + base64.b64encode(data).decode()

    return [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url("video/mp4", video)}},
                {"type": "image_url", "image_url": {"url": url("image/png", image)}},
                {"type": "text", "text": text},
            ],
        }
    ]


def in_process(cluster: Cluster, tiny_checkpoint, chat: list[dict]) -> tuple[list[int], int, int]:
    """(greedy tokens, prompt length, unpruned prompt length) of the request, run here."""
    served = resolve_model(load_config(cluster.config_path))
    assert served.family.video_pruning_rate == Q
    # The proxy's own parsing, under its default limits (the request is well within them).
    parsed, media = parse_messages(chat, Limits(32 << 20, 32, 16384, 8192))
    prepared = RequestBuilder(served).build(parsed, media, epd_pb2.SamplingParams())
    processor = served.family.processor()
    encoder = served.family.load_encoder(served.dtype, torch.device("cpu"))
    with torch.inference_mode():
        outputs = encoder.embed([processor.preprocess(i.media) for i in prepared.items])
    engine = make_engine(tiny_checkpoint, family=served.family)
    features, loaded = [], {}
    for item, out in zip(prepared.items, outputs, strict=True):
        g = item.grid
        features.append(
            MMFeature(
                item.mm_hash,
                item.offset,
                item.length,
                None,
                g.modality,
                g.grid_thw,
                g.second_per_grid_t,
            )
        )
        loaded[item.mm_hash] = engine.load_embedding(item.mm_hash, out, item.length)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    request = Request("here", list(prepared.prompt_token_ids), params, features)
    tokens = run(engine, (request, loaded))["here"].token_ids
    unpruned = len(prepared.prompt_token_ids) + sum(
        i.grid.num_unpruned_tokens - i.length for i in prepared.items if i.grid.num_unpruned_tokens
    )
    return tokens, len(prepared.prompt_token_ids), unpruned


def test_evs_cluster_equals_in_process_and_caches(cluster, tiny_checkpoint):
    video = make_video("mp4", 16, 4, 112, 112, seed=31, still_every=2)
    chat = messages(video, image_bytes(64, 56, 5), "Describe the clip and the picture.")
    want, prompt_len, unpruned = in_process(cluster, tiny_checkpoint, chat)
    assert prompt_len < unpruned
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    kwargs = dict(
        model="tiny",
        messages=chat,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    first = client.chat.completions.create(**kwargs)
    assert first.choices[0].model_extra["token_ids"] == want
    assert first.usage.prompt_tokens == prompt_len
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    held = cluster.metric("epd_mm_items_total", result="held")
    second = client.chat.completions.create(**kwargs)
    assert second.choices[0].model_extra["token_ids"] == want
    # Both items held (the kept set depends only on content and q), none encoded again.
    assert cluster.metric("epd_mm_items_total", result="held") == held + 2
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded
    # The prompt's full blocks come from the prefix cache (pruned placeholders hash as any).
    assert second.usage.prompt_tokens_details.cached_tokens > 0
