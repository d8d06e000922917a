"""The shipped speech model through the whole cluster (real processes: embedded Redis, two
encoders, an LM worker, the proxy): held-out sentences sent to /v1/audio/transcriptions (the
`openai` client) and streamed in realtime sessions (gRPC Realtime, GET /v1/realtime) come
back as their words.

Where the random test models only show that tokens match, here a session handed another
session's audio embeddings, or its decode steps fed the wrong positions' audio, writes other
words. Every transcript is also held to the reference path's (our modules, no cluster, the
same bf16 weights) for the same clip. Sentences are spoken by espeak-ng (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import soundfile

from models.demo import SPEECH_DIR, speech, train_speech
from tests.test_realtime_cluster import grpc_session, ws_session
from tests.test_speech_demo import WORD_ACCURACY_FLOOR, needs_espeak

HELD_OUT = range(24)  # of the held-out sentences (seeds 0 .. 499)
RATE = speech.RATE


@pytest.fixture(scope="module")
def bank():
    needs_espeak()
    return speech.WordBank()


@pytest.fixture(scope="module")
def reference(bank):
    """seed -> (the sentence, the reference path's transcript) for HELD_OUT."""
    _, _, pairs = train_speech.evaluate(SPEECH_DIR, HELD_OUT, bank=bank)
    return dict(zip(HELD_OUT, pairs, strict=True))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, bank):
    from tests.cluster_helpers import Cluster

    c = Cluster(
        tmp_path_factory.mktemp("speech"),
        SPEECH_DIR,
        encoders=2,
        proxy={"realtime_idle_timeout_seconds": 10.0},
    )
    yield c
    c.stop()


def pcm16(utt: speech.Utterance) -> bytes:
    """The utterance as the raw PCM16 samples a realtime client sends."""
    samples, _ = soundfile.read(io.BytesIO(utt.wav()), dtype="int16")
    return samples.astype("<i2").tobytes()


def test_openai_client_transcribes_held_out_sentences(cluster, bank, reference, tmp_path):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")

    def transcribe(seed: int) -> str:
        path = tmp_path / f"{seed}.wav"
        path.write_bytes(speech.utterance(seed, bank).wav())
        with open(path, "rb") as f:
            return client.audio.transcriptions.create(model="tiny", file=f).text

    with ThreadPoolExecutor(8) as pool:  # concurrent requests, on both encoders
        texts = dict(zip(HELD_OUT, pool.map(transcribe, HELD_OUT), strict=True))
    right = total = 0
    for seed, text in texts.items():
        r, n = speech.word_accuracy(reference[seed][0], text)
        right, total = right + r, total + n
    assert right / total >= WORD_ACCURACY_FLOOR, texts
    same = [seed for seed in HELD_OUT if texts[seed].strip() == reference[seed][1]]
    assert len(same) >= len(HELD_OUT) - 1, {s: (texts[s], reference[s]) for s in HELD_OUT}


def _said_right(reference, count: int) -> list[int]:
    """The first `count` held-out seeds the reference path transcribes word for word."""
    seeds = [s for s in HELD_OUT if reference[s][0] == reference[s][1]]
    assert len(seeds) >= count
    return seeds[:count]


def test_grpc_realtime_writes_each_word_while_the_sentence_is_spoken(cluster, bank, reference):
    seed = _said_right(reference, 1)[0]
    utt = speech.utterance(seed, bank)
    responses, last_sent = grpc_session(cluster, pcm16(utt))
    text = "".join(r.text for _, r in responses).strip()
    assert text == utt.text
    # The first word came back while the rest was still being spoken: well before the last
    # chunk, and not before the audio that holds it was sent.
    first_at = next(t for t, r in responses if r.text.strip())
    assert first_at < last_sent - 0.5
    first = next(r for _, r in responses if r.text.strip())
    assert first.audio_seconds >= utt.spans[0][1] / RATE


def test_concurrent_websocket_sessions_each_hear_their_own_sentence(cluster, bank, reference):
    seeds = _said_right(reference, 4)
    utts = [speech.utterance(s, bank) for s in seeds]
    assert len({u.text for u in utts}) == 4

    async def sessions():
        return await asyncio.gather(*(ws_session(cluster, pcm16(u)) for u in utts))

    for utt, (events, _) in zip(utts, asyncio.run(sessions()), strict=True):
        done = events[-1][1]
        assert done["type"] == "transcription.done", events[-1]
        assert done["text"].strip() == utt.text


def test_a_sentence_in_silence_is_still_its_words(cluster, bank, reference):
    """Two seconds of silence before the sentence: positions far from the prompt."""
    seed = _said_right(reference, 1)[0]
    utt = speech.utterance(seed, bank)
    padded = np.concatenate([np.zeros(2 * RATE, np.float32), utt.samples])
    buf = io.BytesIO()
    soundfile.write(buf, padded, RATE, format="WAV", subtype="PCM_16")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    result = client.audio.transcriptions.create(model="tiny", file=("late.wav", buf.getvalue()))
    r, n = speech.word_accuracy(utt.text, result.text)
    assert r >= n - 1, (utt.text, result.text)


def test_speech_eval_and_say_from_the_command_line(cluster, reference, tmp_path, capsys):
    from epd.cli import main as epd_main

    target = f"127.0.0.1:{cluster.proxy_grpc}"
    assert epd_main(["speech-eval", "--target", target, "--count", "6"]) == 0
    summary = json.loads(capsys.readouterr().out)
    want = [reference[s] for s in range(6)]
    assert summary["sentences"] == 6 and summary["words"] == sum(len(w.split()) for w, _ in want)
    exact = sum(w == got for w, got in want)  # the reference path's, give or take a near-tie
    assert abs(summary["sentences_exact"] - exact) <= 1
    assert summary["word_accuracy"] >= 0.9  # the target (one word wrong in 6 here)

    wav = tmp_path / "said.wav"
    assert epd_main(["say", str(wav), "--text", "The yellow star is at the top"]) == 0
    assert capsys.readouterr().out.startswith("the yellow star is at the top (")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    with open(wav, "rb") as f:
        text = client.audio.transcriptions.create(model="tiny", file=f, response_format="text")
    assert text.strip() == "the yellow star is at the top"
    assert epd_main(["say", str(wav), "--text", "a red banana"]) == 2
    assert "banana" in capsys.readouterr().err
