"""`epd bench encoder --video`: what EVS saves on one clip, next to EVS off.

Both sides take the same MP4 (made here with PyAV: a textured scene with a moving square and
static stretches, so some tokens repeat the previous frame and some do not), the same checkpoint
and the same prompt; only `video_pruning_rate` differs (the chosen q vs 0). Per side and round:

    decode + sample + preprocess -> tower (-> EVS prune) -> LM engine: prefill -> first token

Time to first token is that whole path, in process (no network, no Redis): the encode part
shrinks nothing with EVS (the tower still sees every frame) while the prompt, and so prefill,
loses q of the video's tokens. The sides alternate round by round so drift hits both alike;
medians are reported. Prints one line per round and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from common.config import LMConfig
from common.served_model import ensure_bench_model
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import FamilyOptions, MediaInput, MMFeature, SamplingParams, load_family
from models.tokenizer import expand_placeholders


def make_clip(seconds: float, fps: int, side: int, seed: int = 0) -> bytes:
    """An MP4 (H.264): a random texture, a square moving across it for the first half, then
    still; every frame carries light noise (so no token repeats exactly)."""
    import av

    rng = np.random.default_rng(seed)
    scene = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    frames = int(seconds * fps)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = scene.copy()
            x = min(i, frames // 2) * (side // 2) // max(frames // 2, 1)
            frame[side // 4 : side // 4 + side // 4, x : x + side // 4] = (250, 40, 40)
            noise = rng.integers(-3, 4, frame.shape)
            frame = np.clip(frame.astype(np.int16) + noise, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def cpu_model() -> str:
    """The CPU's model name (figures differ between machines: print it with them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Side:
    """One video pruning rate: its family, processor, tower and LM engine."""

    def __init__(self, checkpoint: Path, q: float, device: str):
        self.family = load_family(checkpoint, FamilyOptions(video_pruning_rate=q))
        self.processor = self.family.processor()
        self.dtype = torch.float32
        self.encoder = self.family.load_encoder(self.dtype, torch.device(device))
        lm = LMConfig(device=device, kv_cache_bytes=1 << 30, max_num_batched_tokens=4096)
        self.engine = build_engine(lm, self.family, self.dtype, registry=None)
        self.tokenizer = self.family.tokenizer()
        self.count = 0

    @torch.inference_mode()
    def first_token(self, video: bytes) -> dict:
        self.count += 1
        started = time.perf_counter()
        processed = self.processor.preprocess(MediaInput("video", video=video))
        (out,) = self.encoder.embed([processed])
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        encoded = time.perf_counter()
        grid = processed.grid
        content = [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}]
        ids = self.tokenizer.encode(
            self.tokenizer.apply_chat_template([{"role": "user", "content": content}])
        )
        video_id = self.family.placeholder_token_ids["video"]
        ids, ((offset, length),) = expand_placeholders(ids, (video_id,), [grid.num_tokens])
        mm_hash = f"clip-{self.count}"
        loaded = self.engine.load_embedding(mm_hash, out, length)
        feature = MMFeature(
            mm_hash, offset, length, None, "video", grid.grid_thw, grid.second_per_grid_t
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = Request(f"r{self.count}", ids, params, [feature])
        self.engine.add_request(request, lambda _: None, {mm_hash: loaded})
        self.engine.run_to_completion()
        done = time.perf_counter()
        return {
            "video_tokens": grid.num_tokens,
            "prompt_tokens": len(ids),
            "ttft_seconds": done - started,
            "encode_seconds": encoded - started,
            "prefill_seconds": done - encoded,
        }


def run(args: argparse.Namespace) -> int:
    if args.model:
        checkpoint, model = Path(args.model), args.model
    else:
        print("using the built-in small model (written on first use)", flush=True)
        checkpoint, model = ensure_bench_model(), "random small (qwen2_5_vl)"
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    device = args.device
    clip = make_clip(args.video_seconds, args.video_fps, args.video_size)
    sides = {"evs_off": Side(checkpoint, 0.0, device), "evs": Side(checkpoint, args.q, device)}
    for side in sides.values():  # untimed: first shapes, allocator, thread pools
        side.first_token(clip)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            res = sides[name].first_token(clip)
            runs[name].append(res)
            print(
                f"round {r}  {name:<8} {res['video_tokens']:6d} video tokens  "
                f"ttft {1000 * res['ttft_seconds']:8.1f} ms  "
                f"(encode {1000 * res['encode_seconds']:7.1f} ms, "
                f"prefill {1000 * res['prefill_seconds']:7.1f} ms)",
                flush=True,
            )
    med = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    off, evs = med["evs_off"], med["evs"]
    summary = {
        "bench": "encoder-video",
        "device": device,
        "cpu": cpu_model(),
        "model": model,
        "clip": f"{args.video_seconds:g} s, {args.video_fps} fps, {args.video_size}px, "
        f"{len(clip)} bytes (mp4)",
        "video_pruning_rate": args.q,
        "rounds": args.rounds,
        "tokens_per_video_off": int(off["video_tokens"]),
        "tokens_per_video_evs": int(evs["video_tokens"]),
        "ttft_ms_off": round(1000 * off["ttft_seconds"], 1),
        "ttft_ms_evs": round(1000 * evs["ttft_seconds"], 1),
        "ttft_evs_vs_off": round(evs["ttft_seconds"] / off["ttft_seconds"], 3),
        "prefill_evs_vs_off": round(evs["prefill_seconds"] / off["prefill_seconds"], 3),
        "results": med,
    }
    print(json.dumps(summary))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--video",
        action="store_true",
        help="video mode: tokens per video and time to first token, EVS at --q vs off",
    )
    p.add_argument("--q", type=float, default=0.75, help="video mode: the pruning rate (0.75)")
    p.add_argument("--video-seconds", type=float, default=8.0, help="video mode: clip length (8)")
    p.add_argument("--video-fps", type=int, default=24, help="video mode: clip frame rate (24)")
    p.add_argument("--video-size", type=int, default=336, help="video mode: square side px (336)")
