"""GPU check for Voxtral Realtime (skipped without CUDA): transcriptions whose decode steps
run in CUDA graphs captured from dummy_inputs_embeds (each step's audio row is added to the
token embedding outside the graph, in the static buffer) give the same tokens as eager decode
and as transformers' generate."""

from __future__ import annotations

import pytest
import torch

from common.config import LMConfig
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import MMFeature, SamplingParams, load_family
from models.testing import make_checkpoint
from models.voxtral_realtime import audio as audio_io
from tests.lm_helpers import Collected
from tests.voxtral_helpers import hf_model, hf_processor, speech_like

pytestmark = pytest.mark.cuda


def transcribe(checkpoint, family, clips, graphs: str) -> tuple[list[list[int]], int]:
    lm = LMConfig(
        device="cuda", cuda_graphs=graphs, kv_cache_bytes=64 << 20, max_model_len=512, block_size=8
    )
    engine = build_engine(lm, family, torch.float32, registry=None)
    replays = 0
    if engine.runner.graphs is not None:
        replay = engine.runner.graphs.replay

        def counting(size):
            nonlocal replays
            replays += 1
            return replay(size)

        engine.runner.graphs.replay = counting
    sinks = []
    for i, embeds in enumerate(clips):
        prompt, offset, length = family.transcription_prompt(embeds.shape[0])
        feature = MMFeature(f"h{i}", offset, length, modality="audio")
        request = Request(f"r{i}", prompt, SamplingParams(temperature=0.0), [feature])
        sinks.append(Collected())
        engine.add_request(request, sinks[-1], {f"h{i}": embeds.to("cuda")})
    engine.run_to_completion()
    return [s.token_ids for s in sinks], replays


def test_graph_realtime_decode_equals_eager_and_transformers(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "vx", "voxtral_realtime")
    family = load_family(checkpoint)
    encoder = family.load_encoder(torch.float32, torch.device("cuda"))
    processor, model = hf_processor(checkpoint), hf_model(checkpoint)
    clips, expected = [], []
    for i, seconds in enumerate((0.6, 1.7, 3.1)):
        samples = speech_like(seconds, seed=i)
        padded = torch.from_numpy(audio_io.pad_for_transcription(samples, family.streaming))
        clips.append(encoder.model(encoder.log_mel(padded.to("cuda"))))
        hf = processor(samples, return_tensors="pt", sampling_rate=16000)
        with torch.no_grad():
            expected.append(model.generate(**hf)[0].tolist()[len(hf["input_ids"][0]) :])
    eager, _ = transcribe(checkpoint, family, clips, "off")
    graphed, replays = transcribe(checkpoint, family, clips, "on")
    assert replays > 0
    assert graphed == eager == expected
