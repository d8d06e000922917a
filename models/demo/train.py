"""Train the built-in model: a tiny Qwen2.5-VL that answers questions about the scene world
(models/demo/scenes.py), with our own model code, on the CPU.

    out = train(Path("demo-model"), TrainSettings())   # config, tokenizer, weights (bf16)
    evaluate(out, range(500))                           # exact-match accuracy, held-out

The checkpoint is a Hugging Face layout directory like the random ones (models/testing/make.py
writes the same config files): a byte-level BPE trained on the world's questions and answers,
the family's special tokens and chat template, `Qwen2_5_VLForConditionalGeneration` weights in
bf16. Training runs the serving model's own modules: the vision tower's differentiable
`forward` and the LM with `PackedCausalAttention`, a backend that attends causally within each
whole sequence of a packed batch (no KV cache). The loss is the answer's tokens (and the
closing <|im_end|>) given the chat prompt as the proxy renders it, plus training-only
auxiliary losses: per vision token the shape there (heads not saved), and attention
supervision (`AttentionProbe`: a question's last row first reads the words that name a shape,
then that shape's tokens).

Deterministic: training samples are scenes.sample(TRAIN_SEED_BASE + i), the held-out set is
scenes.sample(0 .. 499), and weights start from torch.manual_seed(settings.seed); the same
settings and thread count give the same bytes. The default seed was chosen on validation
scenes, scenes.sample(500 .. 1499), neither held out nor trained on (KA's two draws); the
shipped model (TB, models/demo/RUNS.md) is the defaults' first draw.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer as _HFTokenizer

from models.demo import scenes
from models.media import ProcessedMedia
from models.qwen2_vl.config import load_arch_config
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.qwen2_vl.processing import MediaProcessor
from models.qwen2_vl.rope import MediaSpan, mrope_positions
from models.qwen2_vl.vision import VisionTower
from models.testing.make import SHAPES, Shape, _config, _processor_configs
from models.testing.qwen_files import SPECIAL_TOKENS, bpe_tokenizer
from models.testing.qwen_files import generation_config as _generation_config
from models.testing.qwen_files import tokenizer_config as _tokenizer_config
from models.tokenizer import Tokenizer, expand_placeholders

ARCH = "qwen2_5_vl"
# The auxiliary loss (training only; its head is not saved): per vision token, the colour and
# kind of the shape there. With place labels (the shipped model's) a token belongs to a shape
# within AUX_REACH (a fraction of the picture's side) of the shape's nominal place; with drawn
# labels, to a shape whose drawn disc (widened by half a token) holds the token's centre.
AUX_WEIGHT = 0.5
AUX_REACH = 0.08
# The same on the LM's last hidden state at each vision token, with the shape's place too: the
# tower cannot know where a token is (its rotary positions are relative, its values carry no
# position), the LM can (M-RoPE gives vision tokens their row and column).
LM_AUX_WEIGHT = 0.5
TRAIN_SEED_BASE = 1_000_000  # training samples; the held-out set is seeds 0 .. 499
TOWER_SEED_BASE = 50_000_000  # the tower's pre-training pictures

# The built-in model's sizes: ~0.9M parameters. Pictures are scaled to 40-80 merged tokens
# (e.g. 168x196 to 252x252 pixels; smaller ones are scaled up), so that a shape spans 2-5
# 14-pixel patches across; a question is ~60-200 tokens. At 64-128 tokens (QA) a run cost
# about 1.2x more for no better answers (runs TA-TC, RUNS.md); at 32-64 the descriptions
# and places suffer (TC).
DEMO_SHAPE = replace(
    SHAPES["tiny"],
    vocab_size=0,  # set from the trained tokenizer
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    mrope_section=(4, 6, 6),
    tie_word_embeddings=False,
    vision_depth=3,
    vision_hidden=64,
    vision_heads=2,
    vision_intermediate=128,
    window_size=112,
    # Every block attends over the whole picture: the places' shapes sit on the corners of
    # 112-pixel windows, so windowed blocks would see each shape in pieces.
    fullatt_block_indexes=(0, 1, 2),
    max_pixels=28 * 28 * 80,
    video_max_pixels=28 * 28 * 80,
    min_pixels=28 * 28 * 40,
)


@dataclass(frozen=True)
class TrainSettings:
    # Joint steps: 1350 lost the lookups by name in some draws (80-95% held-out); 1700 with
    # the place words below and balanced workers was QA (64-128 tokens a picture); on the
    # smaller pictures 1700 scored 93.8% (TA), 1950 is the shipped TB.
    steps: int = 1950
    batch_size: int = 48  # questions a joint step
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    # The initialisation's seed (the data are the same at any): 1, the better of two draws on
    # validation scenes (seeds 500-1499, neither held out nor trained on): JA at 0 91.4%, KA
    # at 1 92.9%.
    seed: int = 1
    aux_weight: float = AUX_WEIGHT  # the tower's auxiliary loss (colour and kind per token)
    lm_aux_weight: float = LM_AUX_WEIGHT  # the LM's (colour, kind and place per vision token)
    min_lr: float = 0.05  # the cosine schedule's floor, a fraction of lr
    # Auxiliary labels from where each shape was drawn (scenes.Placed) instead of its nominal
    # place, and the weight of the background class in the tower's auxiliary loss.
    drawn_labels: bool = True
    aux_background_weight: float = 0.3
    # First the tower alone learns the auxiliary task (no LM: a fraction of a joint step's
    # cost), on tower_batch pictures a step at tower_lr; it uses drawn labels.
    tower_steps: int = 600
    tower_batch: int = 16
    tower_lr: float = 5e-3
    # After its phase the tower is frozen: the joint steps run it without gradients (about a
    # third of a step's cost saved) and train the LM to read what it learnt.
    freeze_tower: bool = False
    # Or frozen from this joint step on (0: never): the steps after it cost about 0.42 s
    # against 0.54 before it (run RC, models/demo/RUNS.md: frozen from 1300 of 1700, 95.6%
    # held-out; from 800, run RB, the descriptions and counts were not learnt yet: 90.8%).
    freeze_tower_at: int = 0
    # The LM's M-RoPE base. Its rotary pairs go to the sections (time, height, width) in order
    # of falling frequency; at the usual 1e6 with 16 pairs the width pairs turn by < 0.002 rad
    # per column, so the LM cannot tell left from right in a picture a dozen tokens wide; at
    # 10 they turn by 0.12-0.24 rad (the height pairs by 0.27-0.56).
    rope_theta: float = 10.0
    # Questions asked about each picture in a joint step (the batch holds batch_size //
    # questions_per_picture pictures): the tower runs once per picture and its tokens serve
    # every question about it, so the LM gets more answers per picture drawn and encoded.
    # With share_prefix a third question costs little (3 a picture at 48 a step: 3% more
    # time a step than 2 at 32).
    questions_per_picture: int = 3
    # How often each kind of question is asked in training, in scenes.QUESTION_WEIGHTS'
    # order (describe, colour, count, where, which, same); empty: as in the held-out set
    # (4, 2, 1, 2, 1, 2). Lookups by name are learnt last: they get more.
    question_weights: tuple[int, ...] = (4, 3, 1, 3, 2, 3)
    # The tower's (and its auxiliary head's) learning rate in the joint phase; None: lr.
    vision_lr: float | None = 5e-3
    # Processes that train in data parallel, each on its share of every batch (whole pictures
    # with their questions) with its own torch threads; their gradients are averaged every
    # step (gloo on loopback). Part of the recipe, like the batch size: the result depends on
    # it, not on the machine. Two: small tensors keep one process from using two cores.
    workers: int = 2
    # Attention supervision (training only; 0 turns it off): at each row whose next token
    # names one shape of a picture (its colour or kind in an answer; a "where" question's first
    # answer token), the query heads `attn_heads` of the layers `attn_layers` are pulled onto
    # that shape's vision tokens (the loss: -log of their attention weight there, times
    # attn_weight). Before that the last prompt row must fetch the question's words that name
    # the shape (a colour question's kind, a "which" question's colour, a "where" question's
    # both): in the layers `attn_fetch_layers` the same heads are pulled onto those words.
    attn_weight: float = 1.0
    attn_layers: tuple[int, ...] = (1, 2)
    attn_heads: tuple[int, ...] = (0, 1)
    attn_fetch_layers: tuple[int, ...] = (0,)
    # Read supervision (0: off): at each lookup row of attn_layers, a training-only linear
    # head must tell the looked-up shape's colour, kind and place from what the heads
    # attn_heads read there (their attention output), so that their values carry all three.
    read_weight: float = 1.0
    # Questions about one picture share their prefix (the chat template and the picture) in
    # the LM's packed step: it runs once, not once per question (Layout). The same loss in
    # fewer operations (a step 15-19% cheaper at 2 questions a picture); off, each question
    # is a sequence of its own, as in the recipes before run DA (RUNS.md).
    share_prefix: bool = True
    # "Same scene?" by matching (empty: off): in layer match_layers[0] each shape token of the
    # second picture is pulled with head match_heads[0] onto the first picture's tokens of
    # the same colour and kind (onto the sequence's first token when there are none); in
    # layer match_layers[1] the question's last row is pulled with head match_heads[1] onto
    # the tokens of the shapes the two pictures do not share (the first token when none).
    # Causal attention lets only the second picture look at the first: its tokens can tell
    # whether their shape is in both, and the last row then needs only to find one that is
    # not (a row reading each picture's whole content to compare, run AL, did not learn it).
    match_layers: tuple[int, ...] = (1, 2)
    match_heads: tuple[int, ...] = (3, 2)
    # "Same scene?" place by place (needs match_layers): a shape the second picture lacks, or
    # one moved away from a place, is there in the first picture only, where no token can
    # see the second. So the question's first words, one per place (PLACES' order: "Do" for
    # the left, " these" for the top, ...), each look at both: in layer match_layers[0],
    # head compare_heads[0] onto the first picture's shape at the word's place and
    # compare_heads[1] onto the second's (the first token where there is none). A word whose
    # two shapes differ then marks a difference, and the last row (match_layers[1]) is
    # pulled onto those words besides the second picture's unmatched tokens (instead of onto
    # the first picture's tokens of a lacking shape, which nothing can tell from the others).
    # The two heads may be one: its weight is then split between the two places (each pull
    # is its own loss term). Empty: off (runs MB-MF, RUNS.md; on since QA: the two-picture
    # questions gain what the lookups lose at 1350 steps, and keep it from 1700 on).
    compare_heads: tuple[int, ...] = (2, 3)
    # Each joint step's pictures go to the workers by cost (their vision tokens) rather than
    # in equal counts: a worker given the larger pictures kept the other waiting at the
    # gradients' all-reduce, about 9% of a step. Off: equal counts (the runs before QA).
    balance_workers: bool = True
    # Descriptions in order (attention supervision, needs attn_weight): "a red circle, an
    # orange star and a yellow cross" names the shapes in KINDS' order, so each next shape
    # is the one of the least kind after the last named. Besides the colour and kind rows
    # (lookups), the row before each article looks up the shape it introduces (the article
    # is "an" for orange); that row and the article's row fetch, in attn_fetch_layers, the
    # kind named last; and the row of each kind word, which must choose between ",", " and"
    # and the end, is pulled onto the shapes still to name (onto the first token when none).
    describe_order: bool = True
    # Floats too small for a normal float32 (< 1.2e-38) count as zero in the training
    # threads: a trained model's activations and gradients hold many, and the CPU computes
    # with them tens of times slower (a joint step of a trained model: about 38% dearer).
    flush_denormals: bool = True
    shape: Shape = field(default=DEMO_SHAPE)


Settings = TypeVar("Settings", bound=Any)


def with_overrides(settings: Settings, assignments: Iterable[str]) -> Settings:
    """`settings` (TrainSettings, or the speech model's SpeechSettings) with "FIELD=VALUE" (one
    of its fields) or "shape.FIELD=VALUE" (a model size) applied: values parse as the field's
    current type (a tuple from "a,b,c", a bool from true / false, a float where the default
    is None)."""
    for assignment in assignments:
        name, sep, text = assignment.partition("=")
        target: Any = settings.shape if name.startswith("shape.") else settings
        key = name.removeprefix("shape.")
        if not sep or key not in {f.name for f in dataclasses.fields(target)} or key == "shape":
            fields = [f.name for f in dataclasses.fields(settings) if f.name != "shape"]
            raise ValueError(
                f"not FIELD=VALUE or shape.FIELD=VALUE with a known field: {assignment!r} "
                f"(fields: {', '.join(fields)}; shape.*: the model's sizes)"
            )
        current = getattr(target, key)
        try:
            if isinstance(current, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value: Any = text.lower() in ("true", "1")
            elif isinstance(current, tuple):
                value = tuple(int(v) for v in text.split(",") if v.strip())
            elif current is None or isinstance(current, float):
                value = float(text)
            else:
                value = type(current)(text)
        except ValueError:
            raise ValueError(f"{name}: cannot read {text!r} as {type(current).__name__}") from None
        if target is settings:
            settings = replace(settings, **{key: value})
        else:
            settings = replace(settings, shape=replace(settings.shape, **{key: value}))
    return settings


# -- the checkpoint's files --------------------------------------------------------------------


def train_tokenizer() -> _HFTokenizer:
    """A byte-level BPE on the world's questions and answers and the chat template's words,
    then the family's special tokens."""
    chat = ["system\nYou are a helpful assistant.\n", "user\n", "assistant\n"]
    return bpe_tokenizer((scenes.answer_corpus() + chat) * 4, 512 - len(SPECIAL_TOKENS))


def write_config(out: Path, shape: Shape, rope_theta: float | None = None) -> Shape:
    """Everything but the weights; returns the shape with its vocabulary size."""
    tokenizer = train_tokenizer()
    # Rows past the tokenizer's are never produced; a multiple of 64 keeps matrices aligned.
    shape = replace(shape, vocab_size=-(-tokenizer.get_vocab_size() // 64) * 64)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    out.mkdir(parents=True, exist_ok=True)
    config = _config(ARCH, shape, ids) | {"dtype": "bfloat16"}
    if rope_theta is not None:
        config["text_config"]["rope_parameters"]["rope_theta"] = rope_theta
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(ids))
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids))
    image_proc, video_proc = _processor_configs(ARCH, shape)
    _write_json(out / "preprocessor_config.json", image_proc)
    _write_json(out / "video_preprocessor_config.json", video_proc)
    return shape


def save_weights(out: Path, tower: VisionTower, lm: Qwen2LanguageModel) -> None:
    """The released checkpoints' names (visual.X, model.X, lm_head.weight), bf16."""
    tensors = {f"visual.{k}": v for k, v in tower.state_dict().items()}
    for name, value in lm.state_dict().items():
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = value
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# -- the training model ------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionProbe:
    """Which queries should attend where (attention supervision): per supervised row of the
    packed step, the keys it may see (its sequence, causally) and the keys it should attend
    to; the backend appends each supervised layer's loss to `losses`."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]  # query heads
    rows: torch.Tensor  # [Q] packed token index of each supervised query
    allowed: torch.Tensor  # [Q, T] bool
    targets: torch.Tensor  # [Q, T] bool
    losses: list[torch.Tensor] = field(default_factory=list)
    # Read supervision: per row the (colour, kind, place) labels of the shape it looks up
    # ([Q, 3]); per layer a head (readers[str(layer)]) must tell them from what the heads
    # read there.
    read: torch.Tensor | None = None
    readers: Any = None  # ModuleDict of Linear(len(heads) * head_dim, sum(LABELS))
    read_losses: list[torch.Tensor] = field(default_factory=list)

    def add_loss(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """-log of the attention weight the heads put on the targets, averaged ([T, heads,
        head_dim] q, k and v, kv heads already repeated)."""
        heads = list(self.heads)
        qh, kh = q[self.rows][:, heads], k[:, heads]
        logits = torch.einsum("qhd,thd->qht", qh, kh) * qh.shape[-1] ** -0.5
        logp = logits.masked_fill(~self.allowed[:, None], float("-inf")).log_softmax(-1)
        on = logp.masked_fill(~self.targets[:, None], float("-inf")).logsumexp(-1)
        self.losses.append(-on.mean())
        if self.read is not None:
            out = torch.einsum("qht,thd->qhd", logp.exp(), v[:, heads]).flatten(1)
            self.read_losses.append(label_loss(self.readers[str(layer_idx)](out), self.read))


@dataclass(frozen=True)
class PackedMetadata:
    seq_lens: tuple[int, ...]  # tokens per sequence, packed back to back
    probes: tuple[AttentionProbe, ...] = ()
    # Per sequence, which keys each of its queries sees ([L, L] bool; None: causal); empty:
    # all causal.
    masks: tuple[torch.Tensor | None, ...] = ()


class PackedCausalAttention:
    """The LM's AttentionBackend for training: each sequence of the packed step attends
    causally to itself, whole (no cache). Sequences of similar length are padded to the
    longest of their group of `group` (the padding at the end, where the causal mask keeps it
    from any real query), each group one batched call."""

    def __init__(self, group: int = 8):
        self.group = group
        # The last step's sequence lengths and masks, and their groups: every layer has the
        # same.
        self._last: tuple[tuple[int, ...], tuple[Any, ...], list[Any]] = ((), (), [])

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        attn_metadata: PackedMetadata,
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        for probe in attn_metadata.probes:
            if layer_idx in probe.layers:
                probe.add_loss(layer_idx, q, k, v)
        outs, tokens = [], []
        lens, masks = attn_metadata.seq_lens, attn_metadata.masks
        if self._last[0] != lens or not _same_objects(self._last[1], masks):
            self._last = (lens, masks, list(self._groups(lens, masks)))
        for shape, token_ids, rows, mask in self._last[2]:
            out = F.scaled_dot_product_attention(
                *(_padded(x, token_ids, rows, shape) for x in (q, k, v)),
                attn_mask=mask,
                is_causal=mask is None,
            )
            outs.append(out.transpose(1, 2).flatten(0, 1)[rows])
            tokens.append(token_ids)
        return torch.cat(outs)[torch.argsort(torch.cat(tokens))]

    def _groups(
        self, lens: Sequence[int], masks: Sequence[torch.Tensor | None]
    ) -> Iterator[tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per group of sequences (by length): its padded shape (sequences, longest), its
        tokens' packed positions, the rows those tokens take in the padded layout, and the
        group's mask ([sequences, 1, L, L]; None where all its sequences are causal)."""
        starts = [0, *itertools.accumulate(lens)]
        order = sorted(range(len(lens)), key=lambda i: lens[i])
        for g in range(0, len(order), self.group):
            seqs = order[g : g + self.group]
            L = max(lens[i] for i in seqs)
            token_ids = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in seqs])
            rows = torch.cat([torch.arange(j * L, j * L + lens[i]) for j, i in enumerate(seqs)])
            mask = None
            if any(masks and masks[i] is not None for i in seqs):
                # Padding rows see nothing (their output is zero, and dropped).
                mask = torch.zeros(len(seqs), 1, L, L, dtype=torch.bool)
                for j, i in enumerate(seqs):
                    n = lens[i]
                    own = masks[i] if masks[i] is not None else _causal(n)
                    mask[j, 0, :n, :n] = own
            yield (len(seqs), L), token_ids, rows, mask


def _same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@dataclass(frozen=True)
class Layout:
    """Where a step's examples sit in the packed tokens the LM runs. With shared prefixes,
    examples that begin with the same tokens and picture (the questions about one picture)
    are one packed sequence: their common prefix once, then each one's remaining tokens,
    which see the prefix and themselves only (`masks`). Every example's tokens then have
    the hidden states they would have packed apart, so the loss and its gradients are the
    same (the prefix's gradient is the sum over the examples that share it); the LM runs
    each picture's tokens once instead of once per question."""

    seq_lens: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]  # per example, the packed row of each of its tokens
    masks: tuple[torch.Tensor | None, ...]  # per sequence, as PackedMetadata.masks
    seqs: tuple[int, ...]  # per example, its sequence

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Each sequence's first packed row, and the packed total last."""
        return (0, *itertools.accumulate(self.seq_lens))

    def supervised(
        self, example: int, token: int, keys: torch.Tensor
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """An example's token as a supervised query (AttentionProbe): its packed row, the
        packed keys it attends to ([all packed tokens] bool), and its `keys` packed."""
        seq = self.seqs[example]
        start = self.starts[seq]
        row = int(self.rows[example][token])
        seen = torch.zeros(self.starts[-1], dtype=torch.bool)
        mask = self.masks[seq]
        if mask is None:
            seen[start : row + 1] = True
        else:
            seen[start : start + self.seq_lens[seq]] = mask[row - start]
        return row, seen, self.rows[example][keys]


def layout(batch: Sequence[Example], share_prefix: bool = False) -> Layout:
    """The packed layout of `batch`: each example a causal sequence of its own, or with
    `share_prefix` consecutive examples about the same first picture packed as one (Layout)."""
    groups: list[list[int]] = []
    for i, e in enumerate(batch):
        prev = batch[groups[-1][0]] if groups else None
        if share_prefix and prev and prev.media and e.media and prev.media[0] is e.media[0]:
            groups[-1].append(i)
        else:
            groups.append([i])
    lens: list[int] = []
    rows: list[torch.Tensor] = [torch.empty(0)] * len(batch)
    masks: list[torch.Tensor | None] = []
    seqs = [0] * len(batch)
    start = 0
    for g in groups:
        p = _shared(batch, g)
        if len(g) == 1 or p is None:
            for i in g:
                n = len(batch[i].token_ids)
                rows[i], seqs[i] = torch.arange(start, start + n), len(lens)
                lens.append(n)
                masks.append(None)
                start += n
            continue
        L = p + sum(len(batch[i].token_ids) - p for i in g)
        mask = torch.zeros(L, L, dtype=torch.bool)
        mask[:p, :p] = _causal(p)
        at = p
        for i in g:
            n = len(batch[i].token_ids) - p
            rows[i] = torch.cat(
                [torch.arange(start, start + p), torch.arange(start + at, start + at + n)]
            )
            seqs[i] = len(lens)
            mask[at : at + n, :p] = True
            mask[at : at + n, at : at + n] = _causal(n)
            at += n
        lens.append(L)
        masks.append(mask)
        start += L
    return Layout(tuple(lens), tuple(rows), tuple(masks), tuple(seqs))


def _shared(batch: Sequence[Example], group: list[int]) -> int | None:
    """How many leading tokens the group's examples share (their common prefix, ending
    before any picture other than the first and before each one's last token), or None when
    that does not hold the whole first picture."""
    first = batch[group[0]]
    p = min(len(batch[i].token_ids) - 1 for i in group)
    for i in group:
        e = batch[i]
        p = min([p, *(s.offset for s in e.spans[1:])])
        p = next((j for j in range(p) if e.token_ids[j] != first.token_ids[j]), p)
    span = first.spans[0]
    end = span.offset + first.media[0].grid.num_tokens
    return p if p >= end else None


def _padded(
    x: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """x's rows `token_ids` ([T, heads, head_dim]) at `rows` of a zero [B * L] layout, as
    [B, heads, L, head_dim]. Index copies, not pad_sequence: the latter's per-sequence slice
    copies cost each a copy of the whole padded gradient in backward."""
    flat = x.new_zeros(shape[0] * shape[1], *x.shape[1:])
    flat = flat.index_copy(0, rows, x.index_select(0, token_ids))
    return flat.view(*shape, *x.shape[1:]).transpose(1, 2)


@dataclass
class Example:
    """One sample as the model sees it: the expanded prompt and answer ids, its media."""

    token_ids: list[int]
    num_prompt: int  # the answer (then <|im_end|>) follows
    media: list[ProcessedMedia]
    spans: list[MediaSpan]
    # Per media item, per vision token: the colour, kind and place (1-based; 0: background)
    # of the shape whose place the token covers (the auxiliary losses' targets).
    token_labels: list[torch.Tensor] = field(default_factory=list)  # each [tokens, 3]
    # (row, media index, kind label): the row's next token names that picture's shape of
    # that kind (1-based, as in token_labels); attention supervision's targets.
    lookups: list[tuple[int, int, int]] = field(default_factory=list)
    # (row, the question's tokens that name the shape the answer is about).
    fetches: list[tuple[int, list[int]]] = field(default_factory=list)
    # "Do these two pictures show the same scene?" (the match supervision's questions).
    same_scene: bool = False
    # (row, media index, kind labels): a description's row that chooses what follows a
    # shape's name, and the kinds (1-based) still to name (TrainSettings.describe_order).
    continues: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)


# Pictures already processed, by id(): the picture (kept alive, so that its id stays its own)
# and its media.
Processed = dict[int, tuple[Image.Image, ProcessedMedia]]


class Encoder:
    """Samples -> the model's inputs, exactly as the proxy prepares a chat request."""

    def __init__(self, checkpoint: Path):
        self.arch = load_arch_config(checkpoint)
        self.tokenizer = Tokenizer.from_dir(checkpoint)
        self.processor = MediaProcessor.from_checkpoint(checkpoint)
        self.end = self.tokenizer.required_id("<|im_end|>")
        self._words: dict[int, str] = {}
        # The chat prompt's ids by (question, pictures), the answer's by its text: the world
        # has a few hundred of each, and rendering and encoding them again every step cost
        # a sixth of drawing a batch.
        self._prompts: dict[tuple[str, int], list[int]] = {}
        self._answers: dict[str, list[int]] = {}

    def vision_tokens(self, samples: Sequence[scenes.Sample]) -> int:
        """The vision tokens of questions about one picture (the first picture of each, the
        same one, counted once): what their share of a step costs, nearly (the tower runs
        once per picture, the LM once per token of the shared prefix)."""
        pictures = [samples[0].pictures[0], *(p for x in samples for p in x.pictures[1:])]
        return sum(self.processor.picture_grid(p).num_tokens for p in pictures)

    def word(self, token_id: int) -> str:
        """A token's text without the spaces around it (the supervision's targets are found
        by the words that name them, in every example: each token decoded once)."""
        if token_id not in self._words:
            self._words[token_id] = self.tokenizer.decode([token_id]).strip()
        return self._words[token_id]

    def prompt(self, sample: scenes.Sample, processed: Processed | None = None) -> Example:
        """The chat prompt's ids and media; `processed` lets questions about one picture
        share one ProcessedMedia, which the tower then encodes once."""
        key = (sample.question, len(sample.pictures))
        if key not in self._prompts:
            content: list[dict[str, Any]] = [{"type": "image"} for _ in sample.pictures]
            content.append({"type": "text", "text": sample.question})
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}])
            self._prompts[key] = self.tokenizer.encode(text)
        processed = {} if processed is None else processed
        media = []
        for picture in sample.pictures:
            if id(picture) not in processed:
                processed[id(picture)] = (picture, self.processor.process_picture(picture))
            media.append(processed[id(picture)][1])
        image_token = self.arch.tokens.image_token_id
        ids, runs = expand_placeholders(
            self._prompts[key], [image_token], [m.grid.num_tokens for m in media]
        )
        spans = [
            MediaSpan(offset, m.grid.grid_thw, "image")
            for (offset, _), m in zip(runs, media, strict=True)
        ]
        return Example(ids, len(ids), media, spans)

    def example(
        self,
        sample: scenes.Sample,
        drawn_labels: bool = False,
        processed: Processed | None = None,
        describe_order: bool = False,
    ) -> Example:
        example = self.prompt(sample, processed)
        if sample.answer not in self._answers:
            self._answers[sample.answer] = self.tokenizer.encode(sample.answer)
        example.token_ids += [*self._answers[sample.answer], self.end]
        for scene, placed, m in zip(sample.scenes, sample.placed, example.media, strict=True):
            grid = m.grid.grid_thw
            labels = token_labels(placed, grid, 2) if drawn_labels else place_labels(scene, grid, 2)
            example.token_labels.append(labels)
        example.lookups = self.lookups(sample, example)
        example.fetches = self.fetches(sample, example)
        example.same_scene = sample.question == scenes.SAME_SCENE
        if describe_order:
            self.order(sample, example)
        return example

    def fetches(self, sample: scenes.Sample, example: Example) -> list[tuple[int, list[int]]]:
        """Example.fetches: the last prompt row of a question naming one shape, and the
        question's tokens that name it (after the pictures)."""
        named = {
            "colour": lambda q: [k for k in scenes.KINDS if f" {k}?" in q],
            "which": lambda q: [c for c in scenes.COLOURS if f" {c}?" in q],
            "where": lambda q: q.removesuffix("?").split()[-2:],
        }.get(sample.kind)
        if named is None:
            return []
        words = set(named(sample.question))
        after = max(s.offset for s in example.spans)
        tokens = [
            j for j in range(after, example.num_prompt) if self.word(example.token_ids[j]) in words
        ]
        return [(example.num_prompt - 1, tokens)] if tokens else []

    def lookups(self, sample: scenes.Sample, example: Example) -> list[tuple[int, int, int]]:
        """Example.lookups: each answer token that is a colour or a kind names one shape of
        the picture the answer is about (a scene's shapes differ in both); a "where"
        question's first answer token is about the shape it names."""
        image = _about(sample)
        if image is None:
            return []  # same scene or not: about both
        shapes = sample.scenes[image].shapes
        out = []
        if sample.kind == "where":
            shape = next(s for s in shapes if f" {s.kind}?" in sample.question)
            out.append((example.num_prompt - 1, image, 1 + scenes.KINDS.index(shape.kind)))
        for j in range(example.num_prompt, len(example.token_ids)):
            word = self.word(example.token_ids[j])
            for shape in shapes:
                if word in (shape.kind, shape.colour):
                    out.append((j - 1, image, 1 + scenes.KINDS.index(shape.kind)))
        return out

    def order(self, sample: scenes.Sample, example: Example) -> None:
        """A description's order supervision (TrainSettings.describe_order), added to the
        example's lookups and fetches and set as its continues."""
        image = _about(sample)
        if image is None or not sample.answer.startswith(("a ", "an ")):
            return  # not a description
        shapes = sorted(sample.scenes[image].shapes, key=lambda s: scenes.KINDS.index(s.kind))
        kinds = [1 + scenes.KINDS.index(s.kind) for s in shapes]
        articles, names = [], []  # per shape, its article's and its kind's token
        for j in range(example.num_prompt, len(example.token_ids)):
            word = self.word(example.token_ids[j])
            if word in ("a", "an"):
                articles.append(j)
            elif len(names) < len(articles) and word == shapes[len(names)].kind:
                names.append(j)
        if not len(articles) == len(names) == len(shapes):
            raise ValueError(f"not a description of {shapes}: {sample.answer!r}")
        for i, (article, name) in enumerate(zip(articles, names, strict=True)):
            example.lookups.append((article - 1, image, kinds[i]))
            if i:
                example.fetches += [(article - 1, [names[i - 1]]), (article, [names[i - 1]])]
            example.continues.append((name, image, tuple(kinds[i + 1 :])))


def _about(sample: scenes.Sample) -> int | None:
    """The picture a question is about (None: both, "same scene?")."""
    if sample.question.startswith("What is in the "):  # one of two pictures
        return next(i for i, o in enumerate(scenes.ORDINALS) if f" {o} " in sample.question)
    return 0 if len(sample.scenes) == 1 else None


def place_labels(scene: scenes.Scene, grid_thw: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[tokens, 3]: (colour, kind, place) of the shape at each merged token, 0 for background.
    A shape covers the tokens within AUX_REACH of its nominal place (not where it was drawn)."""
    _, h, w = grid_thw
    rows, cols = h // merge, w // merge
    labels = torch.zeros(rows, cols, 3, dtype=torch.long)
    for shape in scene.shapes:
        fx, fy = scenes.PLACES[shape.place]
        r0, r1 = (max(0, min(rows - 1, int((fy + d) * rows))) for d in (-AUX_REACH, AUX_REACH))
        c0, c1 = (max(0, min(cols - 1, int((fx + d) * cols))) for d in (-AUX_REACH, AUX_REACH))
        labels[r0 : r1 + 1, c0 : c1 + 1] = torch.tensor(shape_labels(shape))
    return labels.view(-1, 3)


def shape_labels(shape: scenes.Shape) -> tuple[int, int, int]:
    """A shape's (colour, kind, place) labels, each 1-based (0 is the background)."""
    return (
        1 + list(scenes.COLOURS).index(shape.colour),
        1 + scenes.KINDS.index(shape.kind),
        1 + list(scenes.PLACES).index(shape.place),
    )


def token_labels(
    placed: Sequence[scenes.Placed], grid_thw: tuple[int, int, int], merge: int
) -> torch.Tensor:
    """[tokens, 3]: (colour, kind, place) of the shape at each merged token, 0 for background.
    A shape covers the tokens whose centre lies within its drawn radius plus half a token (the
    nearest shape's, where two reach). (NumPy, in float32: a fifth of the time of the same
    arithmetic in small torch operations, every step, on the training cores.)"""
    _, h, w = grid_thw
    rows, cols = h // merge, w // merge
    short = min(h, w)
    f32 = np.float32
    # Token centres in units of the picture's shorter side.
    y = (np.arange(rows, dtype=f32) + f32(0.5)) / f32(rows) * f32(h / short)
    x = (np.arange(cols, dtype=f32) + f32(0.5)) / f32(cols) * f32(w / short)
    reach = 0.5 * merge / short
    labels = np.zeros((rows * cols, 3), dtype=np.int64)
    best = np.full(rows * cols, np.inf, dtype=f32)
    for p in placed:
        dy, dx = y - f32(p.y * h / short), x - f32(p.x * w / short)
        d = np.sqrt(dy[:, None] ** 2 + dx[None, :] ** 2).reshape(-1)
        mine = (d < f32(p.radius + reach)) & (d < best)
        best = np.where(mine, d, best)
        labels[mine] = shape_labels(p.shape)
    return torch.from_numpy(labels)


# The label classes' counts, background (0) included: colour, kind, place.
LABELS = (len(scenes.COLOURS) + 1, len(scenes.KINDS) + 1, len(scenes.PLACES) + 1)


def tower_head(hidden_size: int) -> torch.nn.Linear:
    """The tower's auxiliary head (training only): colour and kind logits, background
    included, per vision token (tower_aux_loss)."""
    return torch.nn.Linear(hidden_size, LABELS[0] + LABELS[1])


def tower_aux_loss(
    aux_head: torch.nn.Module,
    embeds: torch.Tensor,
    labels: torch.Tensor,
    background_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The colour and kind cross-entropy of the tower's tokens ([tokens, width], labels
    [tokens, 3]), the background class weighted by `background_weight` (most tokens are
    background); and the share of the tokens on a shape whose kind is right."""
    colour, kind = aux_head(embeds).split(LABELS[:2], -1)
    weights: list[torch.Tensor | None] = [None, None]
    if background_weight != 1.0:
        weights = [torch.ones(n + 1) for n in (len(scenes.COLOURS), len(scenes.KINDS))]
        for w in weights:
            w[0] = background_weight
    loss = F.cross_entropy(colour, labels[:, 0], weight=weights[0]) + F.cross_entropy(
        kind, labels[:, 1], weight=weights[1]
    )
    on = labels[:, 1] > 0
    right = (kind[on, 1:].argmax(-1) + 1 == labels[on, 1]).float().mean()
    return loss, right


def label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of colour, kind and place logits ([N, sum(LABELS)]) against
    labels [N, 3]."""
    return sum(
        F.cross_entropy(part, labels[:, i]) for i, part in enumerate(logits.split(LABELS, -1))
    )


@dataclass(frozen=True)
class Supervision:
    """Attention supervision for one step (see TrainSettings.attn_weight): the loss weight,
    the lookup layers, the heads, the fetch layers; read supervision: per lookup layer a
    head (`readers`, keyed str(layer)) that must tell the looked-up shape's colour, kind and
    place from what the heads read, at `read_weight`; and the match supervision's layers and
    heads (TrainSettings.match_layers)."""

    weight: float
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    fetch_layers: tuple[int, ...] = ()
    readers: torch.nn.ModuleDict | None = None
    read_weight: float = 0.0
    match_layers: tuple[int, ...] = ()
    match_heads: tuple[int, ...] = ()
    compare_heads: tuple[int, ...] = ()


def forward_loss(
    tower: VisionTower,
    lm: Qwen2LanguageModel,
    batch: Sequence[Example],
    merge: int,
    aux_head: torch.nn.Module | None = None,
    lm_aux_head: torch.nn.Module | None = None,
    aux_weight: float = AUX_WEIGHT,
    lm_aux_weight: float = 0.0,
    aux_background_weight: float = 1.0,
    attn: Supervision | None = None,
    share_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the answers' tokens (plus, with `aux_head` / `lm_aux_head`, the
    auxiliary losses; with `attn`, attention supervision), and how many answers were all
    right. `share_prefix`: the LM runs the prefix questions about one picture share once
    (Layout); the same loss."""
    # Each picture once through the tower, however many questions ask about it.
    unique: dict[int, int] = {}  # id(media) -> its index in `media`
    media: list[ProcessedMedia] = []
    unique_labels: list[torch.Tensor] = []
    for e in batch:
        for m, t in itertools.zip_longest(e.media, e.token_labels):
            if id(m) not in unique:
                unique[id(m)] = len(media)
                media.append(m)
                if t is not None:
                    unique_labels.append(t)
    encoded = tower(torch.cat([m.pixel_values for m in media]), [m.grid.grid_thw for m in media])
    aux = torch.zeros(())
    token_labels = [t for e in batch for t in e.token_labels]
    labels = torch.cat(token_labels) if token_labels else None
    if aux_head is not None and unique_labels:
        # The vision tokens alone say what shape of what colour each covers: a direct signal
        # for the tower from the first step, while the LM still answers from priors.
        tokens, labels_once = torch.cat(encoded), torch.cat(unique_labels)
        aux = aux_weight * tower_aux_loss(aux_head, tokens, labels_once, aux_background_weight)[0]
    packing = layout(batch, share_prefix)
    total = packing.starts[-1]
    ids = torch.zeros(total, dtype=torch.long)
    positions = torch.zeros(3, total, dtype=torch.long)
    is_mm = torch.zeros(total, dtype=torch.bool)
    embeds: dict[int, torch.Tensor] = {}  # first packed row of a picture -> its embeddings
    vision_rows, rows, targets, owners = [], [], [], []
    for i, e in enumerate(batch):
        at = packing.rows[i]
        ids[at] = torch.tensor(e.token_ids)
        positions[:, at] = mrope_positions(len(e.token_ids), e.spans, merge)[0]
        for span, m in zip(e.spans, e.media, strict=True):
            n = span.grid_thw[0] * span.grid_thw[1] * span.grid_thw[2] // merge**2
            mine = at[span.offset : span.offset + n]
            is_mm[mine] = True
            embeds[int(mine[0])] = encoded[unique[id(m)]]
            vision_rows.append(mine)
        # Row j predicts token j + 1: the rows before each answer token.
        for j in range(e.num_prompt, len(e.token_ids)):
            rows.append(int(at[j - 1]))
            targets.append(e.token_ids[j])
            owners.append(i)
    x = lm.embed_input_ids(ids, [embeds[r] for r in sorted(embeds)], is_mm)
    probes = _probes(batch, attn, packing) if attn and attn.weight else ()
    masks = packing.masks if any(m is not None for m in packing.masks) else ()
    metadata = PackedMetadata(packing.seq_lens, probes, masks)
    hidden = lm(None, positions, inputs_embeds=x, attn_metadata=metadata)
    if lm_aux_head is not None and labels is not None:
        # The LM's last hidden state at each vision token says what is there and where: the
        # place is known only to the LM (M-RoPE positions), not to the tower. A picture its
        # questions share counts once per question, as packed apart. (The mask's gather is
        # kept where nothing is shared: the same bytes as before sharing existed.)
        seen = hidden[is_mm] if not masks else hidden[torch.cat(vision_rows)]
        aux = aux + lm_aux_weight * label_loss(lm_aux_head(seen), labels)
    logits = lm.compute_logits(hidden[torch.tensor(rows)]).float()
    target = torch.tensor(targets)
    loss = F.cross_entropy(logits, target) + aux
    if probes:
        loss = loss + attn.weight * torch.stack([x for p in probes for x in p.losses]).mean()
        reads = [x for p in probes for x in p.read_losses]
        if reads:
            loss = loss + attn.read_weight * torch.stack(reads).mean()
    wrong = torch.zeros(len(batch)).index_add_(
        0, torch.tensor(owners), (logits.argmax(-1) != target).float()
    )
    return loss, (wrong == 0).sum()


# (row, key tokens) pairs of one example's supervision.
Pairs = list[tuple[int, torch.Tensor]]


def _matches(
    e: Example, by_place: bool = False
) -> tuple[Pairs, tuple[int, torch.Tensor], list[Pairs]]:
    """A two-picture example's match supervision (TrainSettings.match_layers) as (row, key
    tokens) of the example: each shape token of the second picture onto the first picture's
    tokens of its colour and kind; the last prompt row onto the tokens of the shapes either
    picture has and the other lacks. Token 0 where there is nothing to find. With `by_place`
    (TrainSettings.compare_heads) also, per picture, each place word onto that picture's
    shape at its place, and the last row onto the place words whose shapes differ instead of
    onto the first picture's lacking tokens."""
    first, second = e.token_labels
    a, b = e.spans[0].offset, e.spans[1].offset
    sink = torch.tensor([0])
    tokens: Pairs = []
    for t in (second[:, 1] > 0).nonzero().squeeze(1).tolist():
        same = (first[:, 0] == second[t, 0]) & (first[:, 1] == second[t, 1])
        on = same.nonzero().squeeze(1)
        tokens.append((b + t, a + on if len(on) else sink))

    def lacking(x: torch.Tensor, y: torch.Tensor) -> list[int]:
        """x's shape tokens whose shape (colour, kind and place) y does not have."""
        has = {tuple(r) for r in y[y[:, 1] > 0].tolist()}
        return [t for t, r in enumerate(x.tolist()) if r[1] > 0 and tuple(r) not in has]

    keys = [b + t for t in lacking(second, first)]
    places: list[Pairs] = [[], []]
    if by_place:
        # The question's words start after the second picture and its <|vision_end|>.
        words = b + e.media[1].grid.num_tokens + 1
        for i in range(len(scenes.PLACES)):
            shapes = []
            for j, (offset, labels) in enumerate(((a, first), (b, second))):
                on = (labels[:, 2] == i + 1).nonzero().squeeze(1)
                places[j].append((words + i, offset + on if len(on) else sink))
                shapes.append(tuple(labels[on[0], :2].tolist()) if len(on) else None)
            if shapes[0] != shapes[1]:
                keys.append(words + i)
    else:
        keys = [a + t for t in lacking(first, second)] + keys
    return tokens, (e.num_prompt - 1, torch.tensor(keys) if keys else sink), places


def _probes(
    batch: Sequence[Example], attn: Supervision, packing: Layout | None = None
) -> tuple[AttentionProbe, ...]:
    """The step's attention supervision: each example's lookups (onto a shape's vision
    tokens, at `layers`, with the shape's labels for read supervision), fetches (onto the
    question's words, at `fetch_layers`) and matches (a "same scene?" question's, at
    `match_layers`, see _matches) as rows and keys of the packed layout (by default each
    example a sequence of its own)."""
    packing = packing or layout(batch)
    total = packing.starts[-1]
    lookups: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (row, seen keys, targets)
    read: list[torch.Tensor] = []  # per lookup, its shape's labels
    fetches: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    matches: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[], []]  # tokens, last row
    places: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[], []]  # per picture
    continues: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for i, e in enumerate(batch):
        for row, image, kind in e.lookups:
            on = (e.token_labels[image][:, 1] == kind).nonzero().squeeze(1)
            if len(on):
                lookups.append(packing.supervised(i, row, e.spans[image].offset + on))
                read.append(e.token_labels[image][on[0]])
        for row, tokens in e.fetches:
            fetches.append(packing.supervised(i, row, torch.tensor(tokens)))
        for row, image, kinds in e.continues:
            on = torch.isin(e.token_labels[image][:, 1], torch.tensor(kinds)).nonzero().squeeze(1)
            if len(on) or not kinds:  # onto the first token when no shape is left
                keys = e.spans[image].offset + on if len(on) else torch.tensor([0])
                continues.append(packing.supervised(i, row, keys))
        if attn.match_layers and e.same_scene:
            tokens, last, by_place = _matches(e, bool(attn.compare_heads))
            matches[0] += [packing.supervised(i, row, keys) for row, keys in tokens]
            matches[1].append(packing.supervised(i, *last))
            for j, pairs in enumerate(by_place):
                places[j] += [packing.supervised(i, row, keys) for row, keys in pairs]
    probes = []
    reading = attn.readers is not None and attn.read_weight > 0
    sets = [
        (attn.layers, attn.heads, lookups, read),
        (attn.fetch_layers, attn.heads, fetches, []),
        (attn.layers, attn.heads, continues, []),
    ]
    if attn.match_layers:  # two layers, two heads (validated)
        for i, (layer, h) in enumerate(zip(attn.match_layers, attn.match_heads, strict=True)):
            sets.append(((layer,), (h,), matches[i], []))
        for head, pairs in zip(attn.compare_heads, places, strict=False):  # none: no heads
            sets.append(((attn.match_layers[0],), (head,), pairs, []))
    for at, heads, pairs, labels in sets:
        if not at or not pairs:
            continue
        allowed = torch.stack([seen for _, seen, _ in pairs])
        targets = torch.zeros(len(pairs), total, dtype=torch.bool)
        for i, (_, _, keys) in enumerate(pairs):
            targets[i, keys] = True
        rows = torch.tensor([row for row, _, _ in pairs])
        extra = {}
        if reading and labels:
            extra = {"read": torch.stack(labels), "readers": attn.readers}
        probes.append(AttentionProbe(at, heads, rows, allowed, targets, **extra))
    return tuple(probes)


def train(
    out: Path,
    settings: TrainSettings | None = None,
    progress: Callable[[int, int, float, float], None] | None = None,
    save_every: int = 0,
    on_save: Callable[[int], None] | None = None,
) -> Path:
    """Write a trained checkpoint into `out` (created) and return it. `progress(step, steps,
    loss, batch accuracy)` is called after every step; the weights are also saved every
    `save_every` joint steps (0: only at the end), and `on_save(joint steps done)` is called
    after each of those saves (to evaluate the partial checkpoint). With settings.workers > 1
    this process is worker 0 (it saves and reports) and starts the others, each with this
    process's torch thread count."""
    settings = settings or TrainSettings()
    out = Path(out)
    write_config(out, settings.shape, settings.rope_theta)
    validate(settings)  # before any worker starts
    if settings.workers == 1:
        _train(out, settings, progress, save_every, on_save)
        return out
    with tempfile.TemporaryDirectory(prefix="epd-train-") as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        spawn = torch.multiprocessing.get_context("spawn")
        threads = torch.get_num_threads()
        others = [
            spawn.Process(target=_worker, args=(out, settings, rank, store, threads), daemon=True)
            for rank in range(1, settings.workers)
        ]
        for p in others:
            p.start()
        try:
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=settings.workers)
            _train(out, settings, progress, save_every, on_save)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for p in others:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
                    p.join()
        failed = [(i + 1, p.exitcode) for i, p in enumerate(others) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"training workers failed (worker, exit code): {failed}")
    return out


def _worker(out: Path, settings: TrainSettings, rank: int, store: str, threads: int) -> None:
    """A training process other than the first: trains its share of every batch; saves
    nothing (worker 0 does)."""
    torch.set_num_threads(threads)
    keep_freed_memory()
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=settings.workers)
    try:
        _train(out, settings)
    finally:
        dist.destroy_process_group()
    # Done, and every worker past the last barrier: leave without the interpreter's teardown,
    # where gloo's threads were seen to abort the process now and then (SIGABRT, "terminate
    # called without an active exception") after a whole, correct training.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(
    out: Path,
    settings: TrainSettings,
    progress: Callable[[int, int, float, float], None] | None = None,
    save_every: int = 0,
    on_save: Callable[[int], None] | None = None,
) -> None:
    """One worker's training (the whole of it when there is one worker), into `out`, where
    the config is already written."""
    with flushed_denormals(settings.flush_denormals):
        _train_here(out, settings, progress, save_every, on_save)


@contextlib.contextmanager
def flushed_denormals(on: bool) -> Iterator[None]:
    """Compute with float32 denormals flushed to zero (TrainSettings.flush_denormals) inside,
    with the default (what evaluation and serving compute with) after. A per-thread mode (the
    CPU's control register): the recipe's workers compute on this thread alone (one torch
    thread each); intra-op threads made earlier keep theirs."""
    torch.set_flush_denormal(on)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _train_here(
    out: Path,
    settings: TrainSettings,
    progress: Callable[[int, int, float, float], None] | None,
    save_every: int,
    on_save: Callable[[int], None] | None,
) -> None:
    """_train's work, in the thread's denormal mode."""
    rank, workers = _rank_and_workers()
    progress, on_save = (progress, on_save) if rank == 0 else (None, None)
    arch = load_arch_config(out)
    torch.manual_seed(settings.seed)
    tower = VisionTower(arch.vision)
    lm = Qwen2LanguageModel(arch.text, PackedCausalAttention())
    aux_head = tower_head(arch.text.hidden_size)
    lm_aux_head = torch.nn.Linear(arch.text.hidden_size, sum(LABELS))
    _init(tower)
    _init(lm)
    encoder = Encoder(out)
    if settings.tower_steps:
        pretrain_tower(tower, aux_head, encoder, settings, progress)
    heads = [aux_head] + ([lm_aux_head] if settings.lm_aux_weight else [])
    readers = None
    if settings.read_weight:
        width = len(settings.attn_heads) * arch.text.head_dim
        readers = torch.nn.ModuleDict(
            {str(i): torch.nn.Linear(width, sum(LABELS)) for i in settings.attn_layers}
        )
        heads.append(readers)
    frozen = settings.freeze_tower and settings.tower_steps > 0
    if frozen:
        tower.requires_grad_(False)
        aux_head.requires_grad_(False)
    params = [p for m in (tower, lm, *heads) for p in m.parameters() if p.requires_grad]
    groups = []
    vision = [p for m in (tower, aux_head) for p in m.parameters() if p.requires_grad]
    rest = [p for m in (lm, *heads[1:]) for p in m.parameters()]
    for part, lr in ((vision, settings.vision_lr or settings.lr), (rest, settings.lr)):
        if not part:
            continue
        matrices, others = [p for p in part if p.dim() >= 2], [p for p in part if p.dim() < 2]
        groups.append({"params": matrices, "lr": lr, "weight_decay": settings.weight_decay})
        groups.append({"params": others, "lr": lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.98))

    schedule = _warmup_cosine(optimizer, settings.steps, settings.warmup, settings.min_lr)
    merge = arch.vision.spatial_merge_size
    tower.train(not frozen)
    lm.train()

    weights = _question_weights(settings)
    order = settings.describe_order and settings.attn_weight > 0

    def batch_of(step: int) -> list[Example]:
        """This worker's share of the step's samples: whole pictures with their questions."""
        first = TRAIN_SEED_BASE + step * settings.batch_size
        seeds = range(first, first + settings.batch_size)
        per = settings.questions_per_picture

        def asked(s: int, draw: scenes.Drawer | None = None) -> list[scenes.Sample]:
            if per == 1 and not weights:
                return [scenes.sample(s, draw=draw)]
            return scenes.questions(s, min(per, seeds.stop - s), weights, draw)

        if settings.balance_workers and workers > 1:
            # Planned with blank pictures: their sizes without the drawing.
            pictures = _balanced(
                seeds[::per], rank, workers, lambda s: encoder.vision_tokens(asked(s, scenes.blank))
            )
        else:
            pictures = _share(seeds[::per], rank, workers)
        out: list[Example] = []
        for s in pictures:
            processed: Processed = {}
            for sample in asked(s):
                out.append(encoder.example(sample, settings.drawn_labels, processed, order))
        return out

    total = settings.tower_steps + settings.steps
    supervision = Supervision(
        settings.attn_weight,
        settings.attn_layers,
        settings.attn_heads,
        settings.attn_fetch_layers,
        readers,
        settings.read_weight,
        settings.match_layers,
        settings.match_heads,
        settings.compare_heads,
    )
    lm_aux_head = lm_aux_head if settings.lm_aux_weight else None
    for step, batch in enumerate(_prefetched(batch_of, settings.steps)):
        if step == settings.freeze_tower_at and step and not frozen:
            # No more gradients through the tower: its weights (and its head's) leave the
            # all-reduce, the clipping and the optimizer (AdamW skips parameters without one).
            frozen = True
            tower.requires_grad_(False)
            heads[0].requires_grad_(False)
            params = [p for p in params if p.requires_grad]
        loss, right = forward_loss(
            tower,
            lm,
            batch,
            merge,
            None if frozen else heads[0],
            lm_aux_head,
            settings.aux_weight,
            settings.lm_aux_weight,
            settings.aux_background_weight,
            supervision,
            settings.share_prefix,
        )
        if settings.balance_workers and workers > 1:
            # Shares of unequal size: each worker's mean counts by its share of the questions,
            # so that the workers' average weighs every question alike.
            loss = loss * (len(batch) * workers / settings.batch_size)
        loss_value, accuracy = _update(loss, optimizer, schedule, params, right, len(batch))
        if progress:
            progress(settings.tower_steps + step + 1, total, loss_value, accuracy)
        if save_every and (step + 1) % save_every == 0 and step + 1 < settings.steps:
            if rank == 0:
                save_weights(out, tower, lm)
            if on_save:
                # Evaluation builds modules (their initialisation draws from the global
                # generator): fork it so that training goes on with the same numbers.
                with torch.random.fork_rng():
                    on_save(step + 1)
    _check_same_weights(params)
    if rank == 0:
        save_weights(out, tower, lm)
    if workers > 1:
        # Nobody tears its connections down while another still talks over them (a worker
        # leaving as worker 0 saved was seen to abort in gloo's teardown).
        dist.barrier()


def validate(settings: TrainSettings) -> None:
    """Raise ValueError for settings no training can run with."""
    if settings.workers < 1:
        raise ValueError(f"workers: at least 1, got {settings.workers}")
    if not 0 <= settings.freeze_tower_at < max(settings.steps, 1):
        raise ValueError(
            f"freeze_tower_at: a joint step (0 .. {settings.steps - 1}; 0: never), "
            f"got {settings.freeze_tower_at}"
        )
    if settings.match_layers and not len(settings.match_layers) == len(settings.match_heads) == 2:
        raise ValueError(
            f"match_layers and match_heads: two each (or no match_layers), got "
            f"{settings.match_layers} and {settings.match_heads}"
        )
    shape = settings.shape
    for name, values, limit in (
        ("attn_layers", settings.attn_layers, shape.num_layers),
        ("attn_fetch_layers", settings.attn_fetch_layers, shape.num_layers),
        ("attn_heads", settings.attn_heads, shape.num_heads),
        ("match_layers", settings.match_layers, shape.num_layers),
        ("match_heads", settings.match_heads if settings.match_layers else (), shape.num_heads),
        ("compare_heads", settings.compare_heads, shape.num_heads),
    ):
        if any(not 0 <= v < limit for v in values):
            raise ValueError(f"{name}: each from 0 to {limit - 1}, got {values}")
    if settings.compare_heads and not (settings.match_layers and len(settings.compare_heads) == 2):
        raise ValueError(
            f"compare_heads: two (or none), with match_layers; got {settings.compare_heads}"
        )
    _question_weights(settings)


def _question_weights(settings: TrainSettings) -> dict[scenes.QuestionKind, int] | None:
    if not settings.question_weights:
        return None
    if len(settings.question_weights) != len(scenes.QUESTION_WEIGHTS):
        raise ValueError(
            f"question_weights: {len(scenes.QUESTION_WEIGHTS)} weights, one per kind "
            f"{tuple(scenes.QUESTION_WEIGHTS)}, got {settings.question_weights}"
        )
    return dict(zip(scenes.QUESTION_WEIGHTS, settings.question_weights, strict=True))


def _rank_and_workers() -> tuple[int, int]:
    """This worker's number and how many train (0, 1 without a process group)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _share(items: Sequence[Any], rank: int, workers: int) -> Sequence[Any]:
    """Worker `rank`'s contiguous part of `items` (the parts differ by at most one)."""
    return items[rank * len(items) // workers : (rank + 1) * len(items) // workers]


def _balanced(
    items: Sequence[Any], rank: int, workers: int, cost: Callable[[Any], float]
) -> list[Any]:
    """Worker `rank`'s part of `items`, the parts' costs made near equal (the dearest item
    first, each to the part cheapest so far, ties to the lower rank), in `items`' order."""
    costs = [cost(x) for x in items]
    loads = [0.0] * workers
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -costs[i]):
        owner[i] = min(range(workers), key=loads.__getitem__)
        loads[owner[i]] += costs[i]
    return [x for x, w in zip(items, owner, strict=True) if w == rank]


def _check_same_weights(params: list[torch.nn.Parameter]) -> None:
    """Every worker holds worker 0's weights (the same averaged gradients, the same
    optimizer): a difference would mean they trained apart, and is an error."""
    if not dist.is_initialized():
        return
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    first = mine.clone()
    dist.broadcast(first, 0)
    differ = torch.tensor([float(not torch.equal(mine, first))])
    dist.all_reduce(differ)
    if differ.item():
        raise RuntimeError(f"{int(differ.item())} training worker(s) ended with other weights")


def pretrain_tower(
    tower: VisionTower,
    aux_head: torch.nn.Module,
    encoder: Encoder,
    settings: TrainSettings,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> None:
    """The tower (and the auxiliary head) alone on pictures: the colour and kind of the shape
    at each vision token. `progress` gets the share of shape tokens whose kind is right."""
    params = [p for m in (tower, aux_head) for p in m.parameters()]
    optimizer = torch.optim.AdamW(
        params, lr=settings.tower_lr, betas=(0.9, 0.98), weight_decay=0.01
    )
    steps = settings.tower_steps
    schedule = _warmup_cosine(optimizer, steps, max(1, steps // 20), settings.min_lr)
    merge = tower.config.spatial_merge_size

    rank, workers = _rank_and_workers()

    def batch_of(step: int) -> list[tuple[ProcessedMedia, torch.Tensor]]:
        first = TOWER_SEED_BASE + step * settings.tower_batch
        return [
            tower_picture(encoder, first + i, merge)
            for i in _share(range(settings.tower_batch), rank, workers)
        ]

    tower.train()
    total = steps + settings.steps
    for step, batch in enumerate(_prefetched(batch_of, steps)):
        media = [m for m, _ in batch]
        embeds = tower(torch.cat([m.pixel_values for m in media]), [m.grid.grid_thw for m in media])
        loss, right = tower_aux_loss(
            aux_head,
            torch.cat(embeds),
            torch.cat([labels for _, labels in batch]),
            settings.aux_background_weight,
        )
        loss_value, accuracy = _update(loss, optimizer, schedule, params, right, 1)
        if progress:
            progress(step + 1, total, loss_value, accuracy)


def tower_picture(encoder: Encoder, seed: int, merge: int) -> tuple[ProcessedMedia, torch.Tensor]:
    """A picture of a random scene (drawn from random.Random(seed)) as the tower takes it, and
    its tokens' labels (token_labels)."""
    rng = random.Random(seed)
    picture, placed = scenes.draw(scenes.random_scene(rng), rng.getrandbits(32))
    media = encoder.processor.process_picture(picture)
    return media, token_labels(placed, media.grid.grid_thw, merge)


def _prefetched(batch_of: Callable[[int], Any], steps: int) -> Iterator[Any]:
    """batch_of(0 .. steps - 1), each next batch drawn (Pillow, the processor) on a thread
    while the caller trains on this one: both release the GIL for most of their work. Batches
    depend only on their step number."""
    with ThreadPoolExecutor(1) as pool:
        upcoming = pool.submit(batch_of, 0)
        for step in range(steps):
            batch = upcoming.result()
            if step + 1 < steps:
                upcoming = pool.submit(batch_of, step + 1)
            yield batch


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the
    kernel, for the rest of the process (the training command's own). A step allocates and
    frees hundreds of tensors of a few MB; by default each is a fresh mmap whose pages fault
    in one by one (on this project's machines a multiplication into a fresh 4 MB tensor took
    2.4x one into reused memory). False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt's parameters (malloc.h): blocks up to 32 MB (its largest mmap threshold) come
    # from the heap, up to 2 GiB free at the heap's top stays mapped, and the heap grows
    # 256 MiB at a time.
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 2**31 - 1), (m_top_pad, 256 << 20))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


def _warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: int, min_lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup` steps, then a cosine down to `min_lr` (of the base lr)."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def _update(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    params: list[torch.nn.Parameter],
    right: torch.Tensor,
    count: int,
) -> tuple[float, float]:
    """One optimizer step; with several workers, on the mean of their gradients. Returns the
    loss (the workers' mean) and right / count (summed over the workers)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if dist.is_initialized():
        workers = dist.get_world_size()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # One call for everything: the gradients and the figures reported.
        figures = torch.tensor([loss.item(), float(right), float(count)])
        flat = torch.cat([*(g.reshape(-1) for g in grads), figures])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(p).div_(workers)
            offset += g.numel()
        loss_value, right_sum, count_sum = (flat[offset] / workers).item(), *flat[offset + 1 :]
        accuracy = float(right_sum / count_sum)
    else:
        loss_value, accuracy = loss.item(), float(right) / count
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    return loss_value, accuracy


def _init(module: torch.nn.Module) -> None:
    """Linear and embedding weights N(0, 0.02), biases zero, norms one."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)


# -- evaluation --------------------------------------------------------------------------------


@dataclass
class Accuracy:
    right: int = 0
    total: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [right, total]
    mistakes: list[tuple[int, str, str, str]] = field(default_factory=list)  # seed, q, want, got
    answers: dict[int, str] = field(default_factory=dict)  # seed -> the answer given

    @property
    def value(self) -> float:
        return self.right / max(1, self.total)

    def add(self, seed: int, sample: scenes.Sample, got: str) -> None:
        ok = got.strip() == sample.answer
        self.answers[seed] = got
        self.right += ok
        self.total += 1
        counts = self.by_kind.setdefault(sample.kind, [0, 0])
        counts[0] += ok
        counts[1] += 1
        if not ok:
            self.mistakes.append((seed, sample.question, sample.answer, got))

    def summary(self) -> dict[str, Any]:
        return {
            "accuracy": round(self.value, 4),
            "right": self.right,
            "total": self.total,
            "by_kind": {k: f"{r}/{n}" for k, (r, n) in sorted(self.by_kind.items())},
        }


def evaluate(
    checkpoint: Path,
    seeds: Iterable[int] = range(500),
    dtype: torch.dtype = torch.bfloat16,
) -> Accuracy:
    """Exact-match accuracy of greedy answers on scenes.sample(seed) for `seeds`, through the
    reference path (our model code, no cluster) in the served dtype."""
    seeds = list(seeds)
    samples = [scenes.sample(s) for s in seeds]
    accuracy = Accuracy()
    for seed, sample, got in zip(seeds, samples, answers(checkpoint, samples, dtype), strict=True):
        accuracy.add(seed, sample, got)
    return accuracy


def answers(
    checkpoint: Path,
    samples: Sequence[scenes.Sample],
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 50,
) -> list[str]:
    """The reference path's greedy answers to `samples` (our model code, no cluster)."""
    # NOTE: imported here: the reference path is needed only when evaluating.
    from models.sampling import SamplingParams
    from models.testing.reference import PreparedPrompt, ReferenceModel

    model = ReferenceModel(checkpoint, dtype)
    encoder = Encoder(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    out = []
    for i in range(0, len(samples), batch_size):
        prompts = []
        for sample in samples[i : i + batch_size]:
            e = encoder.prompt(sample)
            prompts.append(PreparedPrompt(e.token_ids, e.media, e.spans))
        for ids in model.generate_many(prompts, params):
            out.append(model.tokenizer.decode(ids, skip_special_tokens=True))
    return out


def progress_bar(stream: Any = sys.stderr) -> Callable[[int, int, float, float], None]:
    """A one-line progress bar: step, loss, batch accuracy (smoothed), rate and time left.
    The rate is that of the last 100 steps: the tower's steps are several times cheaper than
    the joint ones, and frozen-tower steps cheaper again, so the mean since the start would
    promise too early an end."""
    start = time.monotonic()
    smooth = {"loss": None, "acc": None}
    recent: collections.deque[tuple[float, int]] = collections.deque([(start, 0)], maxlen=101)

    def show(step: int, steps: int, loss: float, acc: float) -> None:
        for key, value in (("loss", loss), ("acc", acc)):
            old = smooth[key]
            smooth[key] = value if old is None else 0.95 * old + 0.05 * value
        now = time.monotonic()
        elapsed = now - start
        recent.append((now, step))
        then, before = recent[0]
        rate = (step - before) / (now - then) if now > then else 0.0
        width = 30
        filled = width * step // steps
        bar = "#" * filled + "." * (width - filled)
        left = (steps - step) / rate if rate else 0
        stream.write(
            f"\r[{bar}] {step}/{steps} loss {smooth['loss']:.3f} acc {smooth['acc']:.2f} "
            f"{rate:.2f} steps/s, {elapsed / 60:.1f} min, {left / 60:.1f} min left "
        )
        if step == steps:
            stream.write("\n")
        stream.flush()

    return show
