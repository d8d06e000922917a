"""Write a random Qwen3-VL (dense or MoE) checkpoint in the layout transformers' `save_pretrained`
writes for `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` (test
support: no role server imports this): config.json, generation_config.json,
model.safetensors (or shards), tokenizer.json and tokenizer_config.json (the Qwen2-VL family's
tokenizer and chat template, models/testing/qwen_files.py), preprocessor_config.json (16-pixel
patches, mean and std 0.5) and video_preprocessor_config.json.

MoE experts are written as released checkpoints hold them: `mlp.experts.gate_up_proj`
[experts, hidden, 2 x moe_intermediate], `mlp.experts.down_proj` [experts, moe_intermediate,
hidden].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.registry import arch_by_name
from models.testing.qwen_files import (
    INIT_STD,
    SPECIAL_TOKENS,
    generation_config,
    processor_settings,
    random_draw,
    start_checkpoint,
    tokenizer_config,
    train_tokenizer,
    write_json,
    write_weights,
)

ROPE_THETA = 5_000_000.0
PATCH = 16


@dataclass(frozen=True)
class Qwen3Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    max_pixels: int
    video_max_pixels: int  # the whole clip's
    min_pixels: int = 32 * 32 * 4
    # MoE (qwen3_vl_moe only)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 48
    mlp_only_layers: tuple[int, ...] = ()
    max_shard_bytes: int | None = None


SHAPES: dict[str, Qwen3Shape] = {
    "tiny": Qwen3Shape(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,  # not hidden / heads: Qwen3 sets it apart
        mrope_section=(6, 5, 5),
        tie_word_embeddings=False,
        vision_depth=3,
        vision_hidden=32,
        vision_heads=2,
        vision_intermediate=64,
        num_position_embeddings=36,  # a 6 x 6 grid
        deepstack_visual_indexes=(0, 1),
        max_pixels=32 * 32 * 64,
        video_max_pixels=32 * 32 * 128,
        mlp_only_layers=(1,),
    ),
    "small": Qwen3Shape(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=2,
        head_dim=64,
        mrope_section=(12, 10, 10),
        tie_word_embeddings=True,
        vision_depth=8,
        vision_hidden=384,
        vision_heads=6,
        vision_intermediate=1024,
        num_position_embeddings=576,  # 24 x 24
        deepstack_visual_indexes=(1, 3, 5),
        max_pixels=32 * 32 * 256,
        video_max_pixels=32 * 32 * 1024,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        max_shard_bytes=200 * 1024 * 1024,
    ),
}


def make_qwen3_vl_checkpoint(
    out_dir: str | Path, arch: str, size: str = "tiny", seed: int = 0, **overrides: Any
) -> Path:
    shape, out = start_checkpoint(out_dir, SHAPES, size, overrides)
    tokenizer = train_tokenizer(shape.vocab_size - len(SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    moe = arch == "qwen3_vl_moe"
    write_json(out / "config.json", _config(arch, shape, ids, moe))
    write_json(out / "generation_config.json", generation_config(ids))
    write_weights(
        out,
        _tensor_shapes(shape, moe),
        random_draw(seed, std_of=_std_of),
        torch.float32,
        shape.max_shard_bytes,
    )
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    write_json(out / "preprocessor_config.json", _image_processor(shape))
    write_json(out / "video_preprocessor_config.json", _video_processor(shape))
    return out


def _config(arch: str, s: Qwen3Shape, ids: dict[str, int], moe: bool) -> dict[str, Any]:
    text: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": s.head_dim,
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
            "mrope_interleaved": True,
            "mrope_section": list(s.mrope_section),
            "rope_theta": ROPE_THETA,
            "rope_type": "default",
        },
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }
    if moe:
        text |= {
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(s.mlp_only_layers),
            "moe_intermediate_size": s.moe_intermediate_size,
            "num_experts": s.num_experts,
            "num_experts_per_tok": s.num_experts_per_tok,
        }
    vision = {
        "deepstack_visual_indexes": list(s.deepstack_visual_indexes),
        "depth": s.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": s.vision_hidden,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": s.vision_intermediate,
        "model_type": f"{arch}_vision",
        "num_heads": s.vision_heads,
        "num_position_embeddings": s.num_position_embeddings,
        "out_hidden_size": s.hidden_size,
        "patch_size": PATCH,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": [arch_by_name(arch).hf_class],
        "dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "model_type": arch,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": s.tie_word_embeddings,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def _image_processor(s: Qwen3Shape) -> dict[str, Any]:
    return processor_settings(PATCH, [0.5] * 3, [0.5] * 3, "Qwen3VLProcessor") | {
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"longest_edge": s.max_pixels, "shortest_edge": s.min_pixels},
    }


def _video_processor(s: Qwen3Shape) -> dict[str, Any]:
    """transformers' Qwen3VLVideoProcessor settings: the pixel budget is the whole clip's."""
    return processor_settings(PATCH, [0.5] * 3, [0.5] * 3, "Qwen3VLProcessor") | {
        "do_sample_frames": True,
        "fps": 2,
        "max_frames": 768,
        "min_frames": 4,
        "size": {"longest_edge": s.video_max_pixels, "shortest_edge": s.min_pixels},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }


def _tensor_shapes(s: Qwen3Shape, moe: bool) -> dict[str, tuple[int, ...]]:
    h, d = s.hidden_size, s.head_dim
    lm = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {lm + "embed_tokens.weight": (s.vocab_size, h)}
    for i in range(s.num_layers):
        p = f"{lm}layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (s.num_heads * d, h),
            p + "self_attn.k_proj.weight": (s.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (s.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, s.num_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        }
        if moe and i not in s.mlp_only_layers:
            e, m = s.num_experts, s.moe_intermediate_size
            shapes |= {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.experts.gate_up_proj": (e, h, 2 * m),
                p + "mlp.experts.down_proj": (e, m, h),
            }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (s.intermediate_size, h),
                p + "mlp.up_proj.weight": (s.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, s.intermediate_size),
            }
    shapes[lm + "norm.weight"] = (h,)
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)

    v, e = "model.visual.", s.vision_hidden
    shapes |= {
        v + "patch_embed.proj.weight": (e, 3, 2, PATCH, PATCH),
        v + "patch_embed.proj.bias": (e,),
        v + "pos_embed.weight": (s.num_position_embeddings, e),
    }
    for i in range(s.vision_depth):
        p = f"{v}blocks.{i}."
        shapes |= {
            p + "norm1.weight": (e,),
            p + "norm1.bias": (e,),
            p + "norm2.weight": (e,),
            p + "norm2.bias": (e,),
            p + "attn.qkv.weight": (3 * e, e),
            p + "attn.qkv.bias": (3 * e,),
            p + "attn.proj.weight": (e, e),
            p + "attn.proj.bias": (e,),
            p + "mlp.linear_fc1.weight": (s.vision_intermediate, e),
            p + "mlp.linear_fc1.bias": (s.vision_intermediate,),
            p + "mlp.linear_fc2.weight": (e, s.vision_intermediate),
            p + "mlp.linear_fc2.bias": (e,),
        }
    merged = 4 * e
    mergers = [(v + "merger.", e)] + [
        (f"{v}deepstack_merger_list.{i}.", merged) for i in range(len(s.deepstack_visual_indexes))
    ]
    for p, norm in mergers:
        shapes |= {
            p + "norm.weight": (norm,),
            p + "norm.bias": (norm,),
            p + "linear_fc1.weight": (merged, merged),
            p + "linear_fc1.bias": (merged,),
            p + "linear_fc2.weight": (h, merged),
            p + "linear_fc2.bias": (h,),
        }
    return shapes


def _std_of(name: str) -> float:
    # A sharper router than N(0, INIT_STD): tokens prefer clear experts, so the routing (and
    # comparisons with the reference) does not hinge on near ties.
    return 0.5 if name.endswith("mlp.gate.weight") else INIT_STD
