"""Write a random Voxtral Realtime checkpoint in the layout transformers' `save_pretrained`
writes for `VoxtralRealtimeForConditionalGeneration` (test support: no role server imports
this): config.json, generation_config.json, model.safetensors, preprocessor_config.json (the
log-mel settings) and tekken.json (Mistral's tokenizer file with its `audio` section).

tekken.json keeps the first ranks of the Tekken vocabulary mistral-common ships (byte-level
BPE: the 256 byte tokens come first, so any text encodes) after the family's special tokens.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mistral_common
import torch

ARCH_CLASS = "VoxtralRealtimeForConditionalGeneration"

# Special tokens by rank (the order of Mistral's v13 Tekken files); the rest are fillers.
SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
    "[AUDIO]",
    "[BEGIN_AUDIO]",
    "[TRANSCRIBE]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
    "[STREAMING_PAD]",
    "[STREAMING_WORD]",
)
INIT_STD = 0.06


@dataclass(frozen=True)
class VoxtralShape:
    num_special_tokens: int
    num_bpe_tokens: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    audio_hidden: int
    audio_intermediate: int
    audio_layers: int
    audio_heads: int
    audio_head_dim: int
    audio_sliding_window: int
    num_mel_bins: int
    downsample_factor: int
    transcription_delay_ms: float
    n_left_pad_tokens: int

    @property
    def vocab_size(self) -> int:
        return self.num_special_tokens + self.num_bpe_tokens


VOXTRAL_SHAPES: dict[str, VoxtralShape] = {
    "tiny": VoxtralShape(
        num_special_tokens=64,
        num_bpe_tokens=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        sliding_window=24,
        audio_hidden=32,
        audio_intermediate=64,
        audio_layers=2,
        audio_heads=4,
        audio_head_dim=8,
        audio_sliding_window=20,
        num_mel_bins=32,
        downsample_factor=4,
        transcription_delay_ms=480.0,
        n_left_pad_tokens=4,
    ),
    "small": VoxtralShape(
        num_special_tokens=1000,
        num_bpe_tokens=31000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        sliding_window=2048,
        audio_hidden=384,
        audio_intermediate=1536,
        audio_layers=6,
        audio_heads=6,
        audio_head_dim=64,
        audio_sliding_window=750,
        num_mel_bins=128,
        downsample_factor=4,
        transcription_delay_ms=480.0,
        n_left_pad_tokens=16,
    ),
}


def make_voxtral_checkpoint(
    out_dir: str | Path, size: str = "tiny", seed: int = 0, **overrides: Any
) -> Path:
    if size not in VOXTRAL_SHAPES:
        raise ValueError(f"size must be one of {sorted(VOXTRAL_SHAPES)}, got {size!r}")
    s = replace(VOXTRAL_SHAPES[size], **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    _write_json(out / "config.json", voxtral_config(s))
    _write_json(out / "generation_config.json", generation_config())
    from safetensors.torch import save_file

    save_file(_random_weights(s, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "preprocessor_config.json", preprocessor_config(s.num_mel_bins))
    _write_json(out / "tekken.json", tekken(s))
    return out


def voxtral_config(s: VoxtralShape) -> dict[str, Any]:
    return {
        "architectures": [ARCH_CLASS],
        "model_type": "voxtral_realtime",
        "dtype": "float32",
        "audio_config": {
            "model_type": "voxtral_realtime_encoder",
            "hidden_size": s.audio_hidden,
            "intermediate_size": s.audio_intermediate,
            "num_hidden_layers": s.audio_layers,
            "num_attention_heads": s.audio_heads,
            "head_dim": s.audio_head_dim,
            "num_mel_bins": s.num_mel_bins,
            "hidden_act": "silu",
            "activation_function": "gelu",
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_window": s.audio_sliding_window,
            "max_position_embeddings": 1500,
        },
        "text_config": {
            "model_type": "voxtral_realtime_text",
            "vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_window": s.sliding_window,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "downsample_factor": s.downsample_factor,
        "audio_length_per_tok": 2 * s.downsample_factor,
        "default_num_delay_tokens": int(s.transcription_delay_ms // 80),
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": True,
    }


def generation_config() -> dict[str, Any]:
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11}


def preprocessor_config(num_mel_bins: int) -> dict[str, Any]:
    return {
        "feature_extractor_type": "VoxtralRealtimeFeatureExtractor",
        "feature_size": num_mel_bins,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "win_length": 400,
        "padding_value": 0.0,
        "global_log_mel_max": 1.5,
        "return_attention_mask": False,
    }


def tekken(s: VoxtralShape, vocab: list[bytes] | None = None) -> dict[str, Any]:
    """A Tekken v13 tokenizer file: the family's special tokens, then the first
    `num_bpe_tokens` ranks of mistral-common's bundled vocabulary (or `vocab`: the 256 bytes
    first, then tokens each made of two before it), and the audio section."""
    source = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    base = json.loads(source.read_text(encoding="utf-8"))
    if vocab is not None:
        assert len(vocab) == s.num_bpe_tokens, "num_bpe_tokens is the vocabulary's size"
        base["vocab"] = [
            {
                "rank": i,
                "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace"),
            }
            for i, t in enumerate(vocab)
        ]
    special = [
        {"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIAL_TOKENS)
    ]
    special += [
        {"rank": i, "token_str": f"<SPECIAL_{i}>", "is_control": True}
        for i in range(len(SPECIAL_TOKENS), s.num_special_tokens)
    ]
    frame_rate = 16000 / (160 * 2 * s.downsample_factor)
    return {
        "config": {
            "pattern": base["config"]["pattern"],
            "num_vocab_tokens": s.num_bpe_tokens,
            "default_vocab_size": s.vocab_size,
            "default_num_special_tokens": s.num_special_tokens,
            "version": "v13",
        },
        "vocab": base["vocab"][: s.num_bpe_tokens],
        "special_tokens": special,
        "audio": {
            "sampling_rate": 16000,
            "frame_rate": frame_rate,
            "audio_encoding_config": {
                "num_mel_bins": s.num_mel_bins,
                "hop_length": 160,
                "window_size": 400,
            },
            "transcription_format": "streaming",
            "transcription_delay_ms": s.transcription_delay_ms,
            "streaming_look_ahead_ms": 2.5,
            "streaming_look_back_ms": 52.5,
            "streaming_n_left_pad_tokens": s.n_left_pad_tokens,
        },
    }


def tensor_shapes(s: VoxtralShape) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    a, ai = s.audio_hidden, s.audio_heads * s.audio_head_dim
    shapes["audio_tower.embedder.conv1.weight"] = (a, s.num_mel_bins, 3)
    shapes["audio_tower.embedder.conv1.bias"] = (a,)
    shapes["audio_tower.embedder.conv2.weight"] = (a, a, 3)
    shapes["audio_tower.embedder.conv2.bias"] = (a,)
    for i in range(s.audio_layers):
        p = f"audio_tower.layers.{i}."
        shapes |= {
            p + "self_attn_layer_norm.weight": (a,),
            p + "final_layer_norm.weight": (a,),
            p + "self_attn.q_proj.weight": (ai, a),
            p + "self_attn.q_proj.bias": (ai,),
            p + "self_attn.k_proj.weight": (ai, a),
            p + "self_attn.v_proj.weight": (ai, a),
            p + "self_attn.v_proj.bias": (ai,),
            p + "self_attn.o_proj.weight": (a, ai),
            p + "self_attn.o_proj.bias": (a,),
            p + "mlp.gate_proj.weight": (s.audio_intermediate, a),
            p + "mlp.up_proj.weight": (s.audio_intermediate, a),
            p + "mlp.down_proj.weight": (a, s.audio_intermediate),
            p + "mlp.down_proj.bias": (a,),
        }
    shapes["audio_tower.norm.weight"] = (a,)
    h = s.hidden_size
    shapes["multi_modal_projector.linear_1.weight"] = (h, a * s.downsample_factor)
    shapes["multi_modal_projector.linear_2.weight"] = (h, h)
    shapes["language_model.model.embed_tokens.weight"] = (s.vocab_size, h)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i in range(s.num_layers):
        p = f"language_model.model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "ada_rms_norm.linear1.weight": (32, h),
            p + "ada_rms_norm.linear2.weight": (h, 32),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (s.intermediate_size, h),
            p + "mlp.up_proj.weight": (s.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, s.intermediate_size),
        }
    shapes["language_model.model.norm.weight"] = (h,)
    return shapes


def _random_weights(s: VoxtralShape, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(tensor_shapes(s).items()):
        if "norm.weight" in name and "ada_rms_norm" not in name:
            t = torch.rand(shape, generator=gen) * 0.4 + 0.8
        else:
            t = torch.randn(shape, generator=gen) * INIT_STD
        out[name] = t.contiguous()
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
