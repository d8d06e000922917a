"""What the random checkpoints of the Qwen families share (test support: no role server
imports this): the tokenizer (a byte-level BPE trained here on a built-in corpus, with the
families' special tokens), its tokenizer_config.json with a chat template in the Qwen2-VL
format, generation_config.json, and writing weights (sharded past a size) and JSON files.
models/testing/make.py (Qwen2-VL, Qwen2.5-VL) and make_qwen3_vl.py (Qwen3-VL) use it."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

# The family's added tokens, in the family's order, after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading non-letter), single
# digits, punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The Qwen2-VL prompt format: a default system turn, ChatML turns, one vision placeholder per
# media part (optionally numbered with add_vision_id).
CHAT_TEMPLATE = (
    "{%- set seen = namespace(images=0, videos=0) -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if loop.first and message['role'] != 'system' -%}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- else -%}\n"
    "{%- for part in message['content'] -%}\n"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}\n"
    "{%- set seen.images = seen.images + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Picture ' ~ seen.images ~ ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif part['type'] == 'video' or 'video' in part -%}\n"
    "{%- set seen.videos = seen.videos + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Video ' ~ seen.videos ~ ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- elif 'text' in part -%}\n"
    "{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

# Text for the tokenizer's merges: plain prose (ours), then made-up words for vocabulary size.
_PROSE = """\
The cluster splits serving into three roles. Encoders turn images and video frames into
embeddings; language model workers prefill prompts and decode tokens; a proxy in front hashes
every media item, asks the cache what it already holds and routes the rest. Describe the image.
What is in this picture? How many people are there, and what are they doing? Summarise the video
in two sentences. Write a short poem about the sea at night. Explain why the sky is blue.
A red bicycle leans against a white wall, next to a green door and a small window. 0123456789
Numbers, dates (2024-05-17), prices ($3.50), e-mail@example.com, code: x = f(y) + 2 * z;
Café, naïve, résumé, über, señor. Questions? Answers! Lists: one, two, three.
"""

# Random weights are N(0, INIT_STD); NOTE: three times the usual 0.02, so that greedy
# decoding has clear logit gaps and comparisons with the reference do not hinge on ties.
INIT_STD = 0.06

# -- tokenizer ---------------------------------------------------------------------------------


def corpus(num_words: int) -> list[str]:
    """The built-in training text: the prose above, then deterministic made-up words."""
    rng = random.Random(1234)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    syllables += ["th", "ch", "sh", "qu", "ng", "st", "tr"]
    lines = _PROSE.splitlines(keepends=True) * 4
    line: list[str] = []
    for i in range(num_words):
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        line.append(word.capitalize() if i % 11 == 0 else word)
        if len(line) == 12:
            lines.append(" ".join(line) + rng.choice([". ", ", ", "? ", "!\n", ".\n"]))
            line = []
    return lines


def train_tokenizer(bpe_size: int) -> _HFTokenizer:
    """A byte-level BPE with `bpe_size` tokens, then the family's special tokens."""
    # About 12 words per learned merge is enough text to fill the vocabulary.
    tok = bpe_tokenizer(corpus(max(2000, bpe_size * 12)), bpe_size)
    if tok.get_vocab_size(with_added_tokens=False) != bpe_size:
        raise RuntimeError(
            f"BPE training gave {tok.get_vocab_size(with_added_tokens=False)} tokens, wanted "
            f"{bpe_size}"
        )
    return tok


def bpe_tokenizer(texts: Iterable[str], bpe_size: int) -> _HFTokenizer:
    """A byte-level BPE of at most `bpe_size` tokens trained on `texts` (Qwen2's split
    pattern, NFC), then the family's special tokens: the built-in model's and the random
    checkpoints' tokenizers."""
    tok = _HFTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in ids.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }


def processor_settings(
    patch_size: int, mean: list[float], std: list[float], processor_class: str
) -> dict[str, Any]:
    """The preprocessor settings the families' image and video configs share."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": mean,
        "image_std": std,
        "merge_size": 2,
        "patch_size": patch_size,
        "processor_class": processor_class,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
    }


def start_checkpoint(out_dir: str | Path, shapes: dict[str, Any], size: str, overrides: dict):
    """(the size's shape with `overrides` in place, `out_dir` created): FileExistsError when
    the directory holds anything, ValueError for a size `shapes` does not list."""
    if size not in shapes:
        raise ValueError(f"size must be one of {sorted(shapes)}, got {size!r}")
    shape = replace(shapes[size], **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    return shape, out


def random_draw(
    seed: int, device: str = "cpu", std_of: Callable[[str], float] = lambda name: INIT_STD
) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """draw(name, shape) for write_weights: N(0, std_of(name)) weights, norm scales near one
    (biases near zero), not exactly, so a swapped tensor shows; one generator drawn in name
    order, so the same (arch, size, seed) gives the same bytes (on the CPU; `device` cuda
    draws a 7B model's in seconds, other bytes)."""
    gen = torch.Generator(device).manual_seed(seed)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if "norm" in name or "ln_q" in name:
            t = torch.rand(shape, generator=gen, device=device) * 0.4
            return (t + (0.8 if name.endswith("weight") else -0.2)).cpu()
        return (torch.randn(shape, generator=gen, device=device) * std_of(name)).cpu()

    return draw


def write_weights(
    out: Path,
    shapes: dict[str, tuple[int, ...]],
    draw: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype,
    max_shard_bytes: int | None,
) -> None:
    """Tensors `draw(name, shape)` (called in name order, one shard's worth held at a time:
    a 7B checkpoint is never all in memory) written as dtype into model.safetensors, or into
    shards of at most `max_shard_bytes` with model.safetensors.index.json."""
    names = sorted(shapes)
    shards: list[list[str]] = [[]]
    size = total = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * dtype.itemsize
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for shard, file in zip(shards, files, strict=True):
        tensors = {n: draw(n, shapes[n]).to(dtype).contiguous() for n in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(out / "model.safetensors.index.json", index)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
