"""How well a vision tower tells the kind of shape each of its tokens covers: the measure behind
the built-in model's remaining mistakes (RUNS.md, runs LA-LE), cheap enough to compare towers
in minutes where a whole training takes fifteen.

    accuracy = tower_kinds(tower, encoder)   # a linear probe, fitted and scored on fresh pictures
    accuracy.tokens, accuracy.shapes         # share of shape tokens / of shapes (majority) right

A logistic regression on the tower's output rows (what the LM receives) is fitted on the
shape tokens of the FIT pictures and scored on the TEST ones, drawn as the tower's own phase
draws its pictures (train.tower_picture) at seeds no training uses."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from models.demo import scenes, train
from models.demo.train import Encoder, TrainSettings
from models.qwen2_vl.config import load_arch_config
from models.qwen2_vl.vision import VisionTower

FIT = range(10_000_000, 10_000_600)
TEST = range(20_000_000, 20_000_400)


@dataclass
class KindAccuracy:
    tokens: float  # share of shape tokens whose kind the probe tells
    shapes: float  # share of shapes whose tokens' majority tells their kind
    count: int  # shapes scored
    confusions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, taken for)

    def summary(self) -> dict[str, object]:
        return {
            "token_kind": round(self.tokens, 4),
            "shape_kind": round(self.shapes, 4),
            "shapes": self.count,
            "confusions": {f"{a} as {b}": n for (a, b), n in self.confusions.most_common()},
        }


def shape_tokens(
    tower: VisionTower, encoder: Encoder, seeds: range
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """The tower's output rows on the shapes of the seeds' pictures [N, width], their kinds
    [N] (0-based, scenes.KINDS) and the shape each belongs to: (seed, shape's colour label)."""
    merge = tower.config.spatial_merge_size
    rows, kinds, owners = [], [], []
    for seed in seeds:
        media, labels = train.tower_picture(encoder, seed, merge)
        with torch.inference_mode():
            out = tower.embed_multimodal(media.pixel_values, [media.grid.grid_thw])[0]
        on = labels[:, 1] > 0
        rows.append(out[on].float())
        kinds.append(labels[on, 1] - 1)
        owners += [(seed, colour) for colour in labels[on, 0].tolist()]  # colours differ
    return torch.cat(rows), torch.cat(kinds), owners


def tower_kinds(
    tower: VisionTower, encoder: Encoder, fit: range = FIT, test: range = TEST
) -> KindAccuracy:
    """A linear probe's kind accuracy on the tower's output (see the module's docstring)."""
    x, y, _ = shape_tokens(tower, encoder, fit)
    mean, std = x.mean(0), x.std(0) + 1e-6
    weight = torch.zeros(x.shape[1], len(scenes.KINDS), requires_grad=True)
    bias = torch.zeros(len(scenes.KINDS), requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=300)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy((x - mean) / std @ weight + bias, y) + 1e-4 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    x, y, owners = shape_tokens(tower, encoder, test)
    with torch.no_grad():
        guess = ((x - mean) / std @ weight + bias).argmax(-1)
    votes: dict[tuple[int, int], Counter[int]] = defaultdict(Counter)
    truth: dict[tuple[int, int], int] = {}
    for owner, want, got in zip(owners, y.tolist(), guess.tolist(), strict=True):
        votes[owner][got] += 1
        truth[owner] = want
    confusions: Counter[tuple[str, str]] = Counter()
    for owner, counts in votes.items():
        got = counts.most_common(1)[0][0]
        if got != truth[owner]:
            confusions[(scenes.KINDS[truth[owner]], scenes.KINDS[got])] += 1
    right = len(votes) - sum(confusions.values())
    tokens = (guess == y).float().mean().item()
    return KindAccuracy(tokens, right / len(votes), len(votes), confusions)


def checkpoint_tower(checkpoint: Path) -> VisionTower:
    """A checkpoint's vision tower in float32 on the CPU."""
    arch = load_arch_config(checkpoint)
    return VisionTower.from_checkpoint(checkpoint, arch.vision, torch.float32, torch.device("cpu"))


def tower_alone(out: Path, settings: TrainSettings) -> tuple[VisionTower, Encoder]:
    """A tower trained by the recipe's tower phase alone (settings.tower_steps of
    settings.tower_batch pictures; one process, in the training's denormal mode), its config
    written into `out`; and the Encoder of `out`."""
    settings = replace(settings, steps=0)  # the progress bar's total: this phase alone
    train.write_config(out, settings.shape, settings.rope_theta)
    arch = load_arch_config(out)
    torch.manual_seed(settings.seed)
    tower = VisionTower(arch.vision)
    head = train.tower_head(arch.text.hidden_size)
    train._init(tower)
    encoder = Encoder(out)
    with train.flushed_denormals(settings.flush_denormals):
        train.pretrain_tower(tower, head, encoder, settings, train.progress_bar())
    return tower.eval(), encoder
