"""Voxtral Realtime in the LM engine: a whole-clip transcription is a realtime request whose
embedding is already fetched (one MMFeature from position 0 past the prompt). Prefill takes
the first positions' rows, every decode step gathers its own, the request ends when the
positions are consumed; it batches with another transcription and a text-only request in one
step, and its tokens equal transformers' generate."""

from __future__ import annotations

import pytest
import torch

from lm_worker.engine import BadRequest
from lm_worker.request import Request
from models import MMFeature, SamplingParams, load_family
from models.testing import make_checkpoint
from models.testing.attention import ContiguousKVAttention
from models.testing.reference import transcribe as reference_transcribe
from models.voxtral_realtime import audio as audio_io
from tests.lm_helpers import Collected, make_engine
from tests.voxtral_helpers import hf_model, hf_processor, speech_like


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("vx") / "ckpt", "voxtral_realtime")
    family = load_family(path)
    encoder = family.load_encoder(torch.float32, torch.device("cpu"))
    model, processor = hf_model(path), hf_processor(path)
    clips = {}
    for name, seconds in (("a", 0.7), ("b", 2.2)):
        samples = speech_like(seconds, seed=len(name) + int(seconds * 10))
        hf = processor(samples, return_tensors="pt", sampling_rate=16000)
        with torch.no_grad():
            expected = model.generate(**hf)[0].tolist()
        padded = audio_io.pad_for_transcription(samples, family.streaming)
        embeds = encoder.model(encoder.log_mel(torch.from_numpy(padded)))
        clips[name] = (embeds, expected)
    return path, family, clips


def transcription(family, request_id: str, embeds: torch.Tensor, mm_hash: str) -> Request:
    prompt, offset, length = family.transcription_prompt(embeds.shape[0])
    feature = MMFeature(mm_hash, offset, length, modality="audio")
    return Request(request_id, prompt, SamplingParams(temperature=0.0), [feature])


@pytest.mark.parametrize("pad_decodes", [False, True])
def test_transcriptions_and_text_batch_and_equal_generate(voxtral, pad_decodes):
    path, family, clips = voxtral
    engine = make_engine(path, block_size=8, pad_decodes=pad_decodes)
    steps: list[set[str]] = []
    prepare = engine.runner.prepare_inputs

    def recording(batch):
        steps.append({r.request_id for r in batch.requests})
        return prepare(batch)

    engine.runner.prepare_inputs = recording
    sinks = {k: Collected() for k in ("a", "b", "text")}
    for name in ("a", "b"):
        embeds, _ = clips[name]
        request = transcription(family, name, embeds, f"hash-{name}")
        engine.validate(request)
        engine.add_request(request, sinks[name], {f"hash-{name}": embeds})
    tok = family.tokenizer()
    text_ids = [tok.bos_token_id, *tok.encode("the cat sat on the mat")]
    text = Request("text", text_ids, SamplingParams(temperature=0.0, max_tokens=12))
    engine.add_request(text, sinks["text"])
    engine.run_to_completion()

    for name in ("a", "b"):
        embeds, expected = clips[name]
        prompt = family.transcription_prompt(embeds.shape[0])[0]
        assert prompt + sinks[name].token_ids == expected
        assert sinks[name].last.finish_reason == "stop"
        if expected[-1] not in family.eos_token_ids:  # ended by the audio, not EOS
            assert len(expected) == embeds.shape[0]
    assert {"a", "b", "text"} in steps  # one step ran all three
    lm = family.load_language_model(
        ContiguousKVAttention(family.text.num_layers), torch.float32, torch.device("cpu")
    )
    zeros = torch.zeros(len(text_ids) + 12, family.text.hidden_size)
    expected_text = reference_transcribe(lm, zeros, text_ids, set())[:12]
    assert sinks["text"].token_ids == expected_text
    assert not engine.runner.embeddings.embeds  # embeddings released with their requests


def test_placeholders_past_the_prompt_need_a_realtime_model(tiny_checkpoint, voxtral):
    path, family, clips = voxtral
    embeds, _ = clips["a"]
    engine = make_engine(path, max_model_len=embeds.shape[0] - 1)
    with pytest.raises(BadRequest, match="audio fills"):
        engine.validate(transcription(family, "long", embeds, "h"))
    qwen = make_engine(tiny_checkpoint)
    request = Request("q", [1, 2, 3], SamplingParams(), [MMFeature("h", 0, 9, modality="audio")])
    with pytest.raises(BadRequest, match="outside the 3-token prompt"):
        qwen.validate(request)
