"""`epd up --model <a Qwen3-VL-MoE checkpoint>`: the OpenAI API answers with transformers'
greedy tokens, again with the image held in the embedding cache (one entry per item: main
embedding and deepstack levels together), and for a video container (its timestamped prompt
run written by the proxy from the header)."""

from __future__ import annotations

import base64
import signal

import openai
import torch

from models.testing import ImageItem, ReferenceModel, VideoItem, make_checkpoint
from tests.cluster_helpers import Cluster
from tests.lm_helpers import png
from tests.model_helpers import TORCH_THREADS, hf_inputs, make_video
from tests.test_qwen3_vl import hf_class
from tests.test_up import Up

MAX_TOKENS = 12


def test_up_serves_qwen3_vl_moe_with_transformers_tokens(tmp_path):
    path = make_checkpoint(tmp_path / "moe", "qwen3_vl_moe", "tiny", seed=5)
    cluster = Up("--model", str(path), "--encoders", "1")
    try:
        image = png(90, 60, (30, 60, 200))
        text = "What is in the picture?"
        # transformers' greedy tokens for the prompt the proxy builds (same template, same
        # pixels: our preprocessing is held equal to transformers' in test_qwen3_vl.py).
        torch.set_num_threads(TORCH_THREADS)
        ref = ReferenceModel(path)
        prepared = ref.prepare(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            [ImageItem(image)],
        )
        hf = hf_class("qwen3_vl_moe").from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf.generate(
                **hf_inputs(ref, prepared), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        want = out[0, len(prepared.token_ids) :].tolist()

        cluster.wait_serving()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x")
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        kwargs = dict(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": text},
                    ],
                }
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        metric = Cluster.metric.__get__(type("P", (), {"proxy_http": cluster.http_port})())
        first = client.chat.completions.create(**kwargs)
        assert first.usage.prompt_tokens == len(prepared.token_ids)
        assert first.choices[0].model_extra["token_ids"][: len(want)] == want
        assert metric("epd_mm_items_total", result="encoded") == 1
        second = client.chat.completions.create(**kwargs)
        assert (
            second.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]
        )
        assert metric("epd_mm_items_total", result="held") == 1
        assert metric("epd_mm_items_total", result="encoded") == 1
        # A video container: the proxy writes the timestamped run from its header alone.
        video = make_video("mp4", 11, 4, 96, 64, seed=3)
        vmessages = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}
        ]
        vprepared = ref.prepare(vmessages, [VideoItem(container=video)])
        with torch.no_grad():
            out = hf.generate(
                **hf_inputs(ref, vprepared), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        want = out[0, len(vprepared.token_ids) :].tolist()
        vurl = "data:video/mp4;base64," + base64.b64encode(video).decode()
        content = [
            {"type": "video_url", "video_url": {"url": vurl}},
            {"type": "text", "text": text},
        ]
        reply = client.chat.completions.create(
            **{**kwargs, "messages": [{"role": "user", "content": content}]}
        )
        assert reply.usage.prompt_tokens == len(vprepared.token_ids)
        assert reply.choices[0].model_extra["token_ids"][: len(want)] == want
        cluster.proc.send_signal(signal.SIGINT)
        assert cluster.proc.wait(60) == 0
    finally:
        if cluster.proc.poll() is None:
            cluster.proc.kill()
        cluster.proc.wait()
