"""The built-in speech model (models/demo/speech.py, train_speech.py): the spoken world's
sentences and their alignment, the one-token-a-word vocabulary, the transcription targets,
a training run's checkpoint in transformers' layout, and the shipped model's word accuracy
on held-out sentences (our modules, no cluster; tests/test_speech_semantic.py has the cluster).

Sentences are spoken by espeak-ng (Debian's package; .ci/run installs it)."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from models import load_family
from models.demo import SPEECH_DIR, speech, train_speech
from models.demo.train import with_overrides
from models.testing.make_voxtral import tensor_shapes

NO_ESPEAK = "needs espeak-ng: apt-get install espeak-ng (.ci/run installs it)"
# The shipped model's word accuracy on the first held-out sentences must stay at least this
# (it measured 0.992 on sentences 0-499, 3265 of 3290 words: README); the issue asks >= 0.9.
WORD_ACCURACY_FLOOR = 0.97


def needs_espeak() -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip(NO_ESPEAK)


@pytest.fixture(scope="module")
def bank():
    needs_espeak()
    return speech.WordBank()


def test_word_accuracy_counts_substitutions_insertions_and_deletions():
    ref = "a red circle and a blue square"
    assert speech.word_accuracy(ref, ref) == (7, 7)
    assert speech.word_accuracy(ref, "a red circle and a green square") == (6, 7)
    assert speech.word_accuracy(ref, "a red circle a blue blue square") == (5, 7)
    assert speech.word_accuracy(ref, "") == (0, 7)
    assert speech.word_accuracy("a red star", "a red star star star star star") == (0, 3)


def test_an_utterance_is_its_seeds_and_its_words_lie_where_it_says(bank):
    a, b = speech.utterance(7, bank), speech.utterance(7, bank)
    assert a.text == b.text and np.array_equal(a.samples, b.samples)
    assert speech.utterance(8, bank).text != a.text or not np.array_equal(
        speech.utterance(8, bank).samples, a.samples
    )
    assert len(a.spans) == len(a.text.split())
    ends = [0] + [x for span in a.spans for x in span] + [a.samples.shape[0]]
    assert ends == sorted(ends)
    # Loud inside the words, near silence (the added noise) in the pauses between them.
    inside = np.concatenate([a.samples[s:e] for s, e in a.spans])
    gaps = np.concatenate(
        [a.samples[e:s] for (_, e), (s, _) in zip(a.spans, a.spans[1:], strict=False)]
    )
    assert np.sqrt(np.mean(inside**2)) > 10 * np.sqrt(np.mean(gaps**2))
    # Held-out seeds speak anywhere in the range, training seeds on the grid.
    train = speech.utterance(speech.TRAIN_SEED_BASE + 3, bank)
    assert train.speed in speech.SPEEDS and train.pitch in speech.PITCHES
    # A word list: the world's words in any order; the seed's sentence is the same either way.
    listed = speech.utterance(7, bank, words=True)
    assert set(listed.text.split()) <= set(speech.WORDS) and listed.text != a.text
    assert 3 <= len(listed.spans) <= 7
    said = speech.utterance(0, bank, text="A red circle, and a blue square")
    assert said.text == "a red circle and a blue square"
    with pytest.raises(ValueError, match="words outside the spoken world"):
        speech.utterance(0, bank, text="a red banana")


def test_every_word_is_one_token_and_other_text_still_encodes():
    model = train_speech.build(SPEECH_DIR, seed=0)
    words = model.word_ids()
    assert len(set(words.values())) == len(speech.WORDS)
    tok = model.tokenizer
    text = " an orange triangle is at the bottom"
    assert tok.encode(text) == [words[w] for w in text.split()]
    assert tok.decode(tok.encode("Quick, 42 bananas!")) == "Quick, 42 bananas!"


def test_each_word_is_written_after_its_end_in_order(bank):
    model = train_speech.build(SPEECH_DIR, seed=0)
    words = model.word_ids()
    utts = [speech.utterance(s, bank) for s in range(6)]
    mel, ids = train_speech.make_batch(model, utts, 2, words)
    per_tok = model.streaming.samples_per_token
    left = model.streaming.n_left_pad_tokens * per_tok
    assert mel.shape[-1] == 8 * ids.shape[1]
    pad = model.tokenizer.required_id("[STREAMING_PAD]")
    for utt, row in zip(utts, ids.tolist(), strict=True):
        assert row[0] == model.tokenizer.bos_token_id
        at = [i for i, t in enumerate(row) if t != pad][1:]
        assert [row[i] for i in at] == [words[w] for w in utt.text.split()]
        assert at[0] >= model.prompt_len
        for i, (_, end) in zip(at, utt.spans, strict=True):
            assert (i - 2) * per_tok >= left + end - per_tok  # heard the end of the word


def test_training_writes_transformers_layout_that_the_family_serves(tmp_path, bank):
    settings = with_overrides(
        train_speech.SpeechSettings(),
        ["steps=3", "batch_size=2", "warmup=1", "shape.audio_layers=1", "shape.num_layers=1"],
    )
    log = io.StringIO()
    out = train_speech.train(tmp_path / "ckpt", settings, stream=log, bank=bank)
    assert "3/3" in log.getvalue()  # the progress bar
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
    assert shapes == tensor_shapes(settings.shape)
    family = load_family(out)
    assert family.architecture == "VoxtralRealtimeForConditionalGeneration"
    right, total, pairs = train_speech.evaluate(out, range(2), bank=bank)
    assert total == sum(len(ref.split()) for ref, _ in pairs) and 0 <= right <= total
    with pytest.raises(FileExistsError):
        train_speech.train(out, settings, bank=bank)


def test_the_shipped_model_transcribes_held_out_sentences(bank):
    torch.set_num_threads(2)
    right, total, pairs = train_speech.evaluate(SPEECH_DIR, range(40), bank=bank)
    assert right / total >= WORD_ACCURACY_FLOOR, [p for p in pairs if p[0] != p[1]]
    # Their word lists (no grammar to go by: the sounds alone; 97.8% on all 500).
    right, total, pairs = train_speech.evaluate(SPEECH_DIR, range(20), bank=bank, words=True)
    assert right / total >= 0.93, [p for p in pairs if p[0] != p[1]]
