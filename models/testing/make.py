"""Write a random Qwen2-VL / Qwen2.5-VL checkpoint in the Hugging Face layout (test support:
no role server imports this).

No machine here can download weights, so tests and benchmarks run on checkpoints this module
writes: config.json, generation_config.json, model.safetensors (or shards plus
model.safetensors.index.json), tokenizer.json (a byte-level BPE trained here on a built-in
corpus, with the family's special tokens), tokenizer_config.json with a chat template in the
Qwen2-VL format, preprocessor_config.json and video_preprocessor_config.json. transformers'
`from_pretrained` loads the directory as it would a downloaded one.

Sizes: `tiny` (tests; milliseconds), `small` (the benchmark model, ~100M LM parameters), and
`3b` / `7b`: Qwen2.5-VL-3B's and -7B's shapes in bf16 (the GPU checks: 7.5 / 16.6 GB, drawn on
`device`, written a shard at a time; their tokenizer keeps a 32k vocabulary inside the
model's). The same (arch, size, seed) always gives the same bytes on the CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from models.checkpoint import read_header, weight_map
from models.qwen2_vl.vision import VISION_TENSORS
from models.registry import arch_by_name
from models.testing.qwen_files import (
    SPECIAL_TOKENS,
    processor_settings,
    random_draw,
    start_checkpoint,
    train_tokenizer,
    write_json,
    write_weights,
)
from models.testing.qwen_files import generation_config as _generation_config
from models.testing.qwen_files import tokenizer_config as _tokenizer_config

Size = Literal["tiny", "small", "3b", "7b"]


@dataclass(frozen=True)
class Shape:
    """Sizes of one checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int  # Qwen2.5-VL MLP width; Qwen2-VL uses vision_hidden * mlp_ratio
    vision_mlp_ratio: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    max_pixels: int
    video_max_pixels: int
    min_pixels: int = 56 * 56
    # Shard the weights when they exceed this many bytes (exercises the index path).
    max_shard_bytes: int | None = None
    dtype: str = "float32"  # the weights as saved
    tokenizer_vocab: int | None = None  # BPE + special tokens; None: vocab_size


# Qwen2.5-VL-3B-Instruct's shapes (its config.json), in bf16; 7b's LM is larger, its vision
# tower the same.
_QWEN25_VL_3B = Shape(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    mrope_section=(16, 24, 24),
    tie_word_embeddings=True,
    vision_depth=32,
    vision_hidden=1280,
    vision_heads=16,
    vision_intermediate=3420,
    vision_mlp_ratio=4,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
    max_pixels=28 * 28 * 1280,
    video_max_pixels=28 * 28 * 768,
    max_shard_bytes=4 << 30,
    dtype="bfloat16",
    tokenizer_vocab=32000,
)


SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(2, 3, 3),
        tie_word_embeddings=False,
        vision_depth=3,
        vision_hidden=32,
        vision_heads=2,
        vision_intermediate=64,
        vision_mlp_ratio=2,
        window_size=56,  # 2x2 merged tokens per window
        fullatt_block_indexes=(1,),
        max_pixels=28 * 28 * 64,
        video_max_pixels=28 * 28 * 16,
    ),
    "small": Shape(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=2,
        mrope_section=(8, 12, 12),
        tie_word_embeddings=True,
        vision_depth=8,
        vision_hidden=384,
        vision_heads=6,
        vision_intermediate=1024,
        vision_mlp_ratio=2,
        window_size=112,
        fullatt_block_indexes=(3, 7),
        max_pixels=28 * 28 * 256,
        video_max_pixels=28 * 28 * 128,
        max_shard_bytes=200 * 1024 * 1024,
    ),
    "3b": _QWEN25_VL_3B,
    "7b": dataclasses.replace(
        _QWEN25_VL_3B,
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        tie_word_embeddings=False,
    ),
}

ROPE_THETA = 1_000_000.0
# Bump when what make_checkpoint writes changes (the built-in model's cache path has it).
FORMAT_VERSION = 1
TOKENS_PER_SECOND = 2


def make_checkpoint(
    out_dir: str | Path,
    arch: str,
    size: Size = "tiny",
    seed: int = 0,
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write a random checkpoint into `out_dir` (created; must be empty) and return it.

    `arch` is a short name from models/registry.py's ARCHITECTURES. `overrides` replace
    fields of the size's `Shape` (e.g. tie_word_embeddings=True). `device`: where the random
    weights are drawn (cuda: a 7B model's in seconds).
    """
    family = arch_by_name(arch).family  # ValueError for a name the registry does not list
    module = family.partition(":")[0]
    if device != "cpu" and module != "models.qwen2_vl":
        raise ValueError(f"{arch} checkpoints are drawn on the CPU (device {device!r} is for "
                         "qwen2_vl and qwen2_5_vl)")  # fmt: skip
    if module == "models.voxtral_realtime":
        from models.testing.make_voxtral import make_voxtral_checkpoint

        return make_voxtral_checkpoint(out_dir, size, seed, **overrides)
    if module == "models.qwen3_vl":
        from models.testing.make_qwen3_vl import make_qwen3_vl_checkpoint

        return make_qwen3_vl_checkpoint(out_dir, arch, size, seed, **overrides)
    if module != "models.qwen2_vl":
        raise ValueError(f"make-model writes no {arch!r} checkpoints (family {family})")
    shape, out = start_checkpoint(out_dir, SHAPES, size, overrides)
    tokenizer = train_tokenizer((shape.tokenizer_vocab or shape.vocab_size) - len(SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    write_json(out / "config.json", _config(arch, shape, ids))
    write_json(out / "generation_config.json", _generation_config(ids))
    write_weights(
        out,
        _tensor_shapes(arch, shape),
        random_draw(seed, device),
        getattr(torch, shape.dtype),
        shape.max_shard_bytes,
    )
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    write_json(out / "tokenizer_config.json", _tokenizer_config(ids))
    image_proc, video_proc = _processor_configs(arch, shape)
    write_json(out / "preprocessor_config.json", image_proc)
    write_json(out / "video_preprocessor_config.json", video_proc)
    return out


def count_parameters(out_dir: str | Path) -> dict[str, int]:
    """Parameters per role of a checkpoint (the LM counts a tied head once)."""
    root = Path(out_dir)
    counts = {"vision": 0, "lm": 0}
    for file in sorted(set(weight_map(root).values())):
        for name, info in read_header(root / file)[0].items():
            numel = 1
            for d in info["shape"]:
                numel *= d
            role = "vision" if VISION_TENSORS(name) is not None else "lm"
            counts[role] += numel
    return counts


# -- configs -----------------------------------------------------------------------------------


def _config(arch: str, s: Shape, ids: dict[str, int]) -> dict[str, Any]:
    text = {
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": 32768,
        "model_type": f"{arch}_text",
        "num_attention_heads": s.num_heads,
        "num_hidden_layers": s.num_layers,
        "num_key_value_heads": s.num_kv_heads,
        "pad_token_id": ids["<|endoftext|>"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_section": list(s.mrope_section),
            "rope_theta": ROPE_THETA,
            "rope_type": "default",
        },
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": s.vocab_size,
    }
    vision: dict[str, Any] = {
        "depth": s.vision_depth,
        "in_channels": 3,
        "initializer_range": 0.02,
        "model_type": f"{arch}_vision",
        "num_heads": s.vision_heads,
        "patch_size": 14,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if arch == "qwen2_vl":
        vision |= {
            "embed_dim": s.vision_hidden,
            "hidden_act": "quick_gelu",
            "hidden_size": s.hidden_size,
            "mlp_ratio": s.vision_mlp_ratio,
        }
    else:
        vision |= {
            "fullatt_block_indexes": list(s.fullatt_block_indexes),
            "hidden_act": "silu",
            "hidden_size": s.vision_hidden,
            "intermediate_size": s.vision_intermediate,
            "out_hidden_size": s.hidden_size,
            "tokens_per_second": TOKENS_PER_SECOND,
            "window_size": s.window_size,
        }
    return {
        "architectures": [arch_by_name(arch).hf_class],
        "dtype": s.dtype,
        "image_token_id": ids["<|image_pad|>"],
        "model_type": arch,
        "text_config": text,
        "tie_word_embeddings": s.tie_word_embeddings,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": dict(sorted(vision.items())),
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def _processor_configs(arch: str, s: Shape) -> tuple[dict[str, Any], dict[str, Any]]:
    processor = "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen2VLProcessor"
    common = processor_settings(
        14, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711], processor
    )
    image = common | {
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"longest_edge": s.max_pixels, "shortest_edge": s.min_pixels},
    }
    video = common | {
        "do_sample_frames": False,
        "size": {"longest_edge": s.video_max_pixels, "shortest_edge": s.min_pixels},
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    return image, video


# -- weights -----------------------------------------------------------------------------------


def _tensor_shapes(arch: str, s: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, under the released checkpoints' names."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (s.vocab_size, s.hidden_size)
    }
    kv = s.num_kv_heads * (s.hidden_size // s.num_heads)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (s.hidden_size,),
            p + "post_attention_layernorm.weight": (s.hidden_size,),
            p + "self_attn.q_proj.weight": (s.hidden_size, s.hidden_size),
            p + "self_attn.q_proj.bias": (s.hidden_size,),
            p + "self_attn.k_proj.weight": (kv, s.hidden_size),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, s.hidden_size),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (s.hidden_size, s.hidden_size),
            p + "mlp.gate_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": (s.hidden_size, s.intermediate_size),
        }
    shapes["model.norm.weight"] = (s.hidden_size,)
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, s.hidden_size)

    e = s.vision_hidden
    shapes["visual.patch_embed.proj.weight"] = (e, 3, 2, 14, 14)
    for i in range(s.vision_depth):
        p = f"visual.blocks.{i}."
        shapes |= {
            p + "norm1.weight": (e,),
            p + "norm2.weight": (e,),
            p + "attn.qkv.weight": (3 * e, e),
            p + "attn.qkv.bias": (3 * e,),
            p + "attn.proj.weight": (e, e),
            p + "attn.proj.bias": (e,),
        }
        if arch == "qwen2_vl":
            mlp = e * s.vision_mlp_ratio
            shapes |= {
                p + "norm1.bias": (e,),
                p + "norm2.bias": (e,),
                p + "mlp.fc1.weight": (mlp, e),
                p + "mlp.fc1.bias": (mlp,),
                p + "mlp.fc2.weight": (e, mlp),
                p + "mlp.fc2.bias": (e,),
            }
        else:
            mlp = s.vision_intermediate
            shapes |= {
                p + "mlp.gate_proj.weight": (mlp, e),
                p + "mlp.gate_proj.bias": (mlp,),
                p + "mlp.up_proj.weight": (mlp, e),
                p + "mlp.up_proj.bias": (mlp,),
                p + "mlp.down_proj.weight": (e, mlp),
                p + "mlp.down_proj.bias": (e,),
            }
    merged = 4 * e
    shapes |= {
        "visual.merger.ln_q.weight": (e,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (s.hidden_size, merged),
        "visual.merger.mlp.2.bias": (s.hidden_size,),
    }
    if arch == "qwen2_vl":
        shapes["visual.merger.ln_q.bias"] = (e,)
    return shapes
