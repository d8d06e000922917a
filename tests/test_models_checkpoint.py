"""Checkpoint I/O: make-model output, config layouts, role-only loading, dtype casting, the
fingerprint, the built-in model and the CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.served_model import ensure_bench_model
from epd.cli import main as epd_main
from models import CheckpointError, load_family
from models.checkpoint import load_tensors
from models.qwen2_vl.config import load_arch_config, load_processor_configs
from models.qwen2_vl.language_model import lm_tensor
from models.qwen2_vl.vision import VISION_TENSORS
from models.testing import make_checkpoint
from models.testing.make import count_parameters
from tests.model_helpers import build_tiny, hf_model

SELECT = {"vision": VISION_TENSORS, "lm": lm_tensor}


def fingerprint(checkpoint: Path, dtype) -> str:
    return load_family(checkpoint).fingerprint(dtype)


FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
}


def digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("ckpt"), "qwen2_5_vl")


def test_make_is_deterministic(tmp_path, tiny):
    again = make_checkpoint(tmp_path / "again", "qwen2_5_vl", "tiny", seed=0)
    other = make_checkpoint(tmp_path / "other", "qwen2_5_vl", "tiny", seed=1)
    assert {p.name for p in tiny.iterdir()} == FILES
    assert digest(again) == digest(tiny)
    changed = {k for k, v in digest(other).items() if digest(tiny)[k] != v}
    assert changed == {"model.safetensors"}
    with pytest.raises(FileExistsError):
        make_checkpoint(tiny, "qwen2_5_vl", "tiny")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("tie", [False, True])
def test_reference_loads_every_tensor(tmp_path, arch, tie):
    from transformers import AutoConfig

    ckpt = build_tiny(tmp_path, arch, tie_word_embeddings=tie)
    model = hf_model(ckpt)
    _, info = type(model).from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert AutoConfig.from_pretrained(ckpt).tie_word_embeddings is tie
    ours = load_arch_config(ckpt)
    assert ours.family == arch and ours.text.tie_word_embeddings is tie
    text = model.config.text_config
    assert ours.text.hidden_size == text.hidden_size
    assert list(ours.text.mrope_section) == text.rope_parameters["mrope_section"]
    assert ours.vision.depth == model.config.vision_config.depth


def flat_config(v5: dict) -> dict:
    """The layout released checkpoints ship: LM keys on top, rope_scaling, in_chans."""
    text = dict(v5["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in v5.items() if k != "text_config"}
    flat |= {k: v for k, v in text.items() if k != "model_type"}
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["torch_dtype"] = flat.pop("dtype")
    vision = dict(flat["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("rope_parameters")
    flat["vision_config"] = vision
    return flat


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_flat_config_layout(tmp_path, arch):
    from transformers import AutoConfig

    ckpt = build_tiny(tmp_path, arch)
    v5 = json.loads((ckpt / "config.json").read_text())
    flat_dir = tmp_path / "flat"
    shutil.copytree(ckpt, flat_dir)
    (flat_dir / "config.json").write_text(json.dumps(flat_config(v5)))
    assert load_arch_config(flat_dir) == load_arch_config(ckpt)
    # The reference reads the flat file to the same numbers.
    ref = AutoConfig.from_pretrained(flat_dir).text_config
    assert (
        ref.rope_parameters["mrope_section"]
        == v5["text_config"]["rope_parameters"]["mrope_section"]
    )


def test_special_tokens_and_eos(tmp_path, tiny):
    cfg = load_arch_config(tiny)
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert cfg.tokens.eos_token_ids == tuple(gen["eos_token_id"])
    # Without generation_config.json: the top level, never text_config's family default.
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    (copy / "generation_config.json").unlink()
    raw = json.loads((copy / "config.json").read_text())
    raw["eos_token_id"] = [11, 12]
    raw["text_config"]["eos_token_id"] = 151645
    (copy / "config.json").write_text(json.dumps(raw))
    assert load_arch_config(copy).tokens.eos_token_ids == (11, 12)


def test_bad_configs(tmp_path, tiny):
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_arch_config(tmp_path)
    copy = tmp_path / "bad"
    shutil.copytree(tiny, copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="must sum to head_dim / 2"):
        load_arch_config(copy)
    raw["architectures"], raw["model_type"] = ["LlamaForCausalLM"], "llama"
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="supported are"):
        load_arch_config(copy)


def test_processor_configs(tiny):
    image, video = load_processor_configs(tiny)
    raw = json.loads((tiny / "preprocessor_config.json").read_text())
    assert (image.min_pixels, image.max_pixels) == (
        raw["size"]["shortest_edge"],
        raw["size"]["longest_edge"],
    )
    raw_video = json.loads((tiny / "video_preprocessor_config.json").read_text())
    assert video.max_pixels == raw_video["size"]["longest_edge"] != image.max_pixels


def test_roles_load_only_their_tensors(tiny):
    vision = load_tensors(tiny, VISION_TENSORS, "vision")
    lm = load_tensors(tiny, lm_tensor, "lm")
    everything = load_file(tiny / "model.safetensors")
    assert len(vision) + len(lm) == len(everything)
    assert all(k.startswith(("blocks.", "patch_embed.", "merger.")) for k in vision)
    assert all(k.startswith(("layers.", "embed_tokens.", "norm.", "lm_head.")) for k in lm)
    for dtype in (torch.bfloat16, torch.float16):
        cast = load_tensors(tiny, VISION_TENSORS, "vision", dtype)
        assert all(t.dtype == dtype for t in cast.values())
        name = "blocks.0.attn.qkv.weight"
        assert torch.equal(cast[name], vision[name].to(dtype))


def test_sharded_and_v5_names(tmp_path, tiny):
    # Shards with an index, and the transformers-5 module names, load the same tensors.
    sharded = make_checkpoint(
        tmp_path / "sharded", "qwen2_5_vl", "tiny", seed=0, max_shard_bytes=40_000
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny, renamed)
    tensors = load_file(renamed / "model.safetensors")
    new_names = {
        (
            "model.visual." + k[len("visual.") :]
            if k.startswith("visual.")
            else "model.language_model." + k[len("model.") :]
            if k.startswith("model.")
            else k
        ): v
        for k, v in tensors.items()
    }
    save_file(new_names, renamed / "model.safetensors")
    for role in ("vision", "lm"):
        want = load_tensors(tiny, SELECT[role], role)
        for other in (sharded, renamed):
            got = load_tensors(other, SELECT[role], role)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
    # The reference agrees that the sharded directory is the same model.
    model = hf_model(sharded)
    assert torch.equal(model.lm_head.weight, load_tensors(tiny, lm_tensor, "lm")["lm_head.weight"])


def test_fingerprint(tmp_path, tiny):
    base = fingerprint(tiny, torch.float32)
    assert len(base) == 16 and int(base, 16) >= 0
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    assert fingerprint(copy, "float32") == base  # another host, same checkpoint
    assert fingerprint(tiny, torch.bfloat16) != base

    raw = json.loads((copy / "preprocessor_config.json").read_text())
    raw["size"]["longest_edge"] *= 2
    (copy / "preprocessor_config.json").write_text(json.dumps(raw))
    assert fingerprint(copy, torch.float32) != base

    for role, changes in (("lm", False), ("vision", True)):
        other = tmp_path / f"weights-{role}"
        shutil.copytree(tiny, other)
        tensors = load_file(other / "model.safetensors")
        name = "visual.blocks.1.mlp.up_proj.bias" if role == "vision" else "model.norm.weight"
        tensors[name] = tensors[name] + 1
        save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
        assert (fingerprint(other, torch.float32) != base) is changes


def test_small_shape_counts():
    from models.testing.make import SHAPES, _tensor_shapes

    params = {"vision": 0, "lm": 0}
    for name, shape in _tensor_shapes("qwen2_5_vl", SHAPES["small"]).items():
        params["vision" if name.startswith("visual.") else "lm"] += torch.Size(shape).numel()
    assert 90e6 < params["lm"] < 110e6
    assert params["vision"] < 25e6


@pytest.mark.parametrize(("size", "lm", "vision"), [("3b", 3.09e9, 0.67e9), ("7b", 7.62e9, 0.68e9)])
def test_real_size_shapes_count_what_the_released_checkpoints_hold(size, lm, vision):
    """`--size 3b | 7b`: Qwen2.5-VL-3B's / -7B's parameter counts (the LM counts a tied head
    once), within 1%: the GPU checks' figures are of models this size."""
    from models.testing.make import SHAPES, _tensor_shapes

    params = {"vision": 0, "lm": 0}
    for name, shape in _tensor_shapes("qwen2_5_vl", SHAPES[size]).items():
        params["vision" if name.startswith("visual.") else "lm"] += torch.Size(shape).numel()
    assert abs(params["lm"] / lm - 1) < 0.01, params
    assert abs(params["vision"] / vision - 1) < 0.01, params


def test_cli_make_model(tmp_path, capsys):
    out = tmp_path / "cli"
    assert epd_main(["make-model", str(out), "--arch", "qwen2_vl", "--size", "tiny"]) == 0
    assert "wrote qwen2_vl tiny" in capsys.readouterr().out
    assert load_arch_config(out).family == "qwen2_vl"
    assert count_parameters(out)["lm"] > 0
    assert epd_main(["make-model", str(out), "--size", "tiny"]) == 2
    assert "not empty" in capsys.readouterr().err
    other = tmp_path / "qwen3"
    assert epd_main(["make-model", str(other), "--arch", "qwen3_vl", "--device", "cuda"]) == 2
    assert "drawn on the CPU" in capsys.readouterr().err


def test_bench_model_written_once_atomically(tmp_path, monkeypatch):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_bench_model(tmp_path, "tiny")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    path = results[0]
    assert {p.name for p in path.iterdir()} == FILES
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary leftovers
    assert ensure_bench_model(tmp_path, "tiny") == path
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path / "env"))
    assert ensure_bench_model(size="tiny").parent.parent == tmp_path / "env"
