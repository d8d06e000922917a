"""Train the built-in speech model: a tiny Voxtral Realtime that transcribes the spoken world
(models/demo/speech.py), with the family's own modules (the audio encoder and the LM that
serve it), in the Hugging Face layout.

A transcription is one LM position per 80 ms of audio: each position's input is its audio
embedding plus the token written at the position before. The model writes `[STREAMING_PAD]`
while there is nothing new to write and a word's token `emit_after` positions after the
position that holds the word's end (later if the previous word's token is still being
written, never inside the prompt). The vocabulary is one token per word (" red", with its
space), built by hand: the 256 bytes, then every word's prefixes, so Tekken's byte-pair
merges make each word one token and any other text still encodes.

Training is teacher-forced over whole clips, padded as a transcription request pads them
(`audio.pad_for_transcription`), a batch of clips at once.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from models.demo import speech
from models.demo.train import _init, _prefetched, _warmup_cosine, progress_bar
from models.registry import load_family
from models.testing.attention import ContiguousKVAttention
from models.testing.make_voxtral import (
    VOXTRAL_SHAPES,
    VoxtralShape,
    _write_json,
    generation_config,
    preprocessor_config,
    tekken,
    voxtral_config,
)
from models.testing.reference import transcribe
from models.voxtral_realtime.audio import LogMel, pad_for_transcription
from models.voxtral_realtime.config import (
    StreamingConfig,
    load_config,
    load_feature_config,
    load_streaming_config,
)
from models.voxtral_realtime.encoder import AudioEncoder
from models.voxtral_realtime.language_model import VoxtralLanguageModel
from models.voxtral_realtime.tokenizer import TekkenTokenizer


def vocabulary() -> list[bytes]:
    """The 256 byte tokens, then every word's space-led prefixes (" r", " re", " red"),
    shorter first: each is a merge of the one before and a byte."""
    pieces = {(" " + w)[:n] for w in speech.WORDS for n in range(2, len(w) + 2)}
    return [bytes([i]) for i in range(256)] + [
        p.encode() for p in sorted(pieces, key=lambda p: (len(p), p))
    ]


SHAPE = replace(
    VOXTRAL_SHAPES["tiny"],
    num_bpe_tokens=len(vocabulary()),
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    sliding_window=64,
    audio_hidden=128,
    audio_intermediate=256,
    audio_layers=3,
    audio_heads=4,
    audio_head_dim=32,
    audio_sliding_window=100,
    num_mel_bins=64,
)


@dataclass(frozen=True)
class SpeechSettings:
    seed: int = 0
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    min_lr: float = 0.05
    weight_decay: float = 0.01
    emit_after: int = 2  # positions from a word's last audio position to its token
    # How often a word's token comes one position later: then the token written at the
    # position before, not the audio alone, must tell whether the word is written yet (with
    # none late, the model wrote short words twice: "a a", "the the").
    late: float = 0.3
    # The share of word lists (speech.word_list: the words in any order) among the sentences:
    # without them the LM learns the grammar and the encoder little (on held-out word lists
    # a model trained on sentences alone got 51% of their words).
    word_lists: float = 0.3
    pad_weight: float = 0.5  # the loss's weight on [STREAMING_PAD] targets
    threads: int = 2
    shape: VoxtralShape = SHAPE


def write_checkpoint_files(out: Path, shape: VoxtralShape) -> None:
    """config.json, generation_config.json, preprocessor_config.json and tekken.json."""
    out.mkdir(parents=True, exist_ok=True)
    config = voxtral_config(shape)
    config["dtype"] = "bfloat16"
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())
    _write_json(out / "preprocessor_config.json", preprocessor_config(shape.num_mel_bins))
    _write_json(out / "tekken.json", tekken(shape, vocabulary()))


class BatchedCausalAttention:
    """The LM's AttentionBackend for training: clips of one length packed back to back
    (attn_metadata: (clips, positions)), each causal over itself within the sliding window."""

    def __call__(self, layer_idx, q, k, v, attn_metadata, sliding_window=None):
        clips, n = attn_metadata
        heads = q.shape[1]
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
        q, k, v = (x.view(clips, n, heads, -1).transpose(1, 2) for x in (q, k, v))
        i = torch.arange(n)
        mask = i[None, :] <= i[:, None]
        if sliding_window is not None:
            mask &= i[:, None] - i[None, :] < sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(clips * n, heads, -1)


@dataclass
class Model:
    encoder: AudioEncoder
    lm: VoxtralLanguageModel
    log_mel: LogMel
    tokenizer: TekkenTokenizer
    streaming: StreamingConfig
    pad_id: int  # [STREAMING_PAD]

    @property
    def prompt_len(self) -> int:
        return 1 + self.streaming.n_left_pad_tokens + self.streaming.num_delay_tokens

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.encoder.parameters(), *self.lm.parameters()]

    def word_ids(self) -> dict[str, int]:
        """Each word's one token (with its leading space)."""
        ids = {}
        for w in speech.WORDS:
            enc = self.tokenizer.encode(" " + w)
            if len(enc) != 1:
                raise ValueError(f"{w!r} is {len(enc)} tokens in this vocabulary, not one")
            ids[w] = enc[0]
        return ids


def build(checkpoint_files: Path, seed: int) -> Model:
    """Fresh modules of the checkpoint's shape (N(0, 0.02) weights, norms one)."""
    arch = load_config(checkpoint_files)
    features = load_feature_config(checkpoint_files)
    torch.manual_seed(seed)
    encoder = AudioEncoder(arch)
    lm = VoxtralLanguageModel(arch.text, BatchedCausalAttention())
    _init(encoder)
    _init(lm)
    lm.lm_head.weight = lm.embed_tokens.weight
    tokenizer = TekkenTokenizer.from_dir(checkpoint_files)
    return Model(
        encoder,
        lm,
        LogMel(features),
        tokenizer,
        load_streaming_config(checkpoint_files, features),
        tokenizer.required_id("[STREAMING_PAD]"),
    )


def token_ids(
    model: Model,
    utt: speech.Utterance,
    positions: int,
    emit_after: int,
    words: dict[str, int],
    late: float = 0.0,
    rng: random.Random | None = None,
) -> list[int]:
    """The transcription's input ids over `positions`: BOS, then [STREAMING_PAD] everywhere
    but at each word's position; with probability `late` (drawn from `rng`) a word's token
    comes one position later."""
    ids = [model.tokenizer.bos_token_id] + [model.pad_id] * (positions - 1)
    per_tok = model.streaming.samples_per_token
    left = model.streaming.n_left_pad_tokens * per_tok
    at = model.prompt_len - 1
    for word, (_, end) in zip(utt.text.split(), utt.spans, strict=True):
        delay = emit_after + (1 if late and rng is not None and rng.random() < late else 0)
        at = max((left + end - 1) // per_tok + delay, at + 1)
        if at >= positions:
            raise ValueError(f"no room for {word!r} in {positions} positions: {utt.text!r}")
        ids[at] = words[word]
    return ids


def make_batch(
    model: Model,
    utts: Sequence[speech.Utterance],
    emit_after: int,
    words: dict[str, int],
    late: float = 0.0,
    rng: random.Random | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-mel [clips, mels, frames], input ids [clips, positions]): every clip padded as a
    transcription request pads it, then with silence to the longest."""
    padded = [pad_for_transcription(u.samples, model.streaming) for u in utts]
    longest = max(p.shape[0] for p in padded)
    samples = np.stack([np.pad(p, (0, longest - p.shape[0])) for p in padded])
    positions = longest // model.streaming.samples_per_token
    ids = [token_ids(model, u, positions, emit_after, words, late, rng) for u in utts]
    return model.log_mel(torch.from_numpy(samples)), torch.tensor(ids)


def forward_loss(
    model: Model, mel: torch.Tensor, ids: torch.Tensor, pad_weight: float
) -> tuple[torch.Tensor, int, int]:
    """Teacher-forced cross-entropy of every token after the prompt (pads weighted
    `pad_weight`), and (words right, words) by greedy argmax at the word positions."""
    clips, positions = ids.shape
    audio = model.encoder.embeddings(mel)  # [clips, positions, hidden]
    lm = model.lm
    lm.set_delay(model.streaming.num_delay_tokens)  # its scales learn too
    x = (lm.embed_tokens(ids) + audio).flatten(0, 1)
    hidden = lm(None, torch.arange(positions).repeat(clips), x, (clips, positions))
    start = model.prompt_len - 1
    logits = lm.compute_logits(hidden.view(clips, positions, -1)[:, start:-1]).float()
    targets = ids[:, start + 1 :]
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    weights = torch.where(targets.flatten() == model.pad_id, pad_weight, 1.0)
    loss = (losses * weights).sum() / weights.sum()
    is_word = targets != model.pad_id
    right = int(((logits.argmax(-1) == targets) & is_word).sum())
    return loss, right, int(is_word.sum())


def save_weights(out: Path, model: Model) -> None:
    """bf16 safetensors under transformers' names."""
    tensors = {}
    for name, p in model.encoder.tower.state_dict().items():
        tensors["audio_tower." + name] = p
    for name, p in model.encoder.projector.state_dict().items():
        tensors["multi_modal_projector." + name] = p
    for name, p in model.lm.state_dict().items():
        if name != "lm_head.weight":  # tied to the embedding
            tensors["language_model.model." + name] = p
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def train(
    out: str | Path,
    settings: SpeechSettings = SpeechSettings(),
    stream: Any = sys.stderr,
    bank: speech.WordBank | None = None,
) -> Path:
    """Train from scratch into `out` (a new or empty directory). The words are spoken first,
    all of them (`WordBank.grid`), unless a `bank` is given (then as they are needed)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    speech.espeak_path()
    torch.set_num_threads(settings.threads)
    write_checkpoint_files(out, settings.shape)
    model = build(out, settings.seed)
    words = model.word_ids()

    started = time.monotonic()
    if bank is None:
        bank = speech.WordBank()
        stream.write("speaking the words (espeak-ng) ...\n")
        bank.fill(speech.WordBank.grid(), threads=settings.threads)
        stream.write(f"{len(bank.clips)} words spoken in {time.monotonic() - started:.0f} s\n")

    def batch_of(step: int):
        base = (
            speech.TRAIN_SEED_BASE + (settings.seed * settings.steps + step) * settings.batch_size
        )
        rng = random.Random(base)
        utts = [
            speech.utterance(base + i, bank, words=rng.random() < settings.word_lists)
            for i in range(settings.batch_size)
        ]
        return make_batch(model, utts, settings.emit_after, words, settings.late, rng)

    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    schedule = _warmup_cosine(optimizer, settings.steps, settings.warmup, settings.min_lr)
    show = progress_bar(stream)
    for step, (mel, ids) in enumerate(_prefetched(batch_of, settings.steps)):
        loss, right, count = forward_loss(model, mel, ids, settings.pad_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        show(step + 1, settings.steps, loss.item(), right / max(1, count))
    save_weights(out, model)
    _write_json(out / "training.json", {"settings": dataclasses.asdict(settings)})
    stream.write(f"trained in {(time.monotonic() - started) / 60:.1f} min\n")
    return out


@torch.inference_mode()
def evaluate(
    checkpoint: str | Path,
    seeds: Iterable[int] = speech.HELD_OUT_SEEDS,
    bank: speech.WordBank | None = None,
    words: bool = False,
) -> tuple[int, int, list[tuple[str, str]]]:
    """(words right, words, (reference, transcript) per sentence) of greedy transcriptions
    of the held-out sentences (their word lists when `words`) with the checkpoint as served
    (bf16 weights, our modules)."""
    family = load_family(checkpoint)
    encoder = family.load_encoder(family.dtype, torch.device("cpu"))
    lm = family.load_language_model(
        ContiguousKVAttention(family.text.num_layers), family.dtype, torch.device("cpu")
    )
    processor = family.processor()
    tokenizer = family.tokenizer()
    bank = bank or speech.WordBank()
    right = total = 0
    pairs = []
    for seed in seeds:
        utt = speech.utterance(seed, bank, words=words)
        item = speech.media_input(utt)
        media = processor.preprocess(item)
        embeds = encoder.embed([media])[0]
        prompt, _, _ = family.transcription_prompt(media.grid.num_tokens)
        ids = transcribe(lm, embeds, prompt, set(family.eos_token_ids))
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        r, n = speech.word_accuracy(utt.text, text)
        right, total = right + r, total + n
        pairs.append((utt.text, text))
    return right, total, pairs
