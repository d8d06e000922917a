"""A video container's frames are resized as they are decoded (issue 58, item 3).

A high-resolution clip compresses well, so a small upload can carry many frames that each cost
width x height x 4 bytes once decoded. Decoding keeps one frame at full size at a time and
resizes it at once to the processor's target size:

- the peak memory a preprocess adds, measured in a child process (PyAV's and Pillow's buffers
  are C allocations that tracemalloc does not see), does not grow by a full-size frame for each
  frame sampled;
- the frames the decoder hands over are already at the target size;
- the pixels equal the processor's output for the same frames given one by one (decoded at full
  size, resized afterwards), so the embeddings do not change.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from models import MediaInput
from models import video as containers
from models.qwen2_vl.config import ProcessorConfig
from models.qwen2_vl.processing import MediaProcessor

ROOT = Path(__file__).resolve().parents[1]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64


def make_smooth_video(num_frames: int, fps: float, width: int, height: int) -> bytes:
    """An MP4 of smooth gradients with a moving square: large frames, a small file."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1)
    base = base.astype(np.uint8)
    side = max(8, min(width, height) // 8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        for i in range(num_frames):
            frame = base.copy()
            top = left = (i * side // 2) % (min(width, height) - side)
            frame[top : top + side, left : left + side] = (255, 255 - 8 * i % 256, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def processor() -> MediaProcessor:
    cfg = ProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return MediaProcessor(cfg, cfg)


# The child: preprocess the file sampling 4 frames (twice: the first warms up), then all of them;
# report the peak RSS each run added (freed memory handed back with malloc_trim, VmHWM reset
# through /proc/self/clear_refs, then read back) and the frames' target size.
CHILD = """
import ctypes, json, sys
from models import MediaInput
from tests.test_video_bounds import make_smooth_video, processor

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

libc = ctypes.CDLL(None)
proc = processor()
data = open(sys.argv[1], "rb").read()
runs = []
for kwargs in ({"max_frames": 4}, {"max_frames": 4}, {}):
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    out = proc.preprocess(MediaInput("video", video=data, kwargs=kwargs))
    runs.append({"added": status("VmHWM") - before,
                 "frames": len(out.grid.video_metadata.frames_indices),
                 "pixel_bytes": out.pixel_values.nbytes})
    del out
_, gh, gw = proc.grid(MediaInput("video", video=data)).grid_thw
print(json.dumps({"runs": runs, "target": [gw * 14, gh * 14]}))
"""


def test_decode_peak_memory_does_not_grow_with_full_size_frames(tmp_path):
    width = height = 2048
    num_frames = 24  # 12 s at 2 fps: every frame is sampled
    data = make_smooth_video(num_frames, 2, width, height)
    assert len(data) < 2_000_000  # a small upload
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    try:
        Path("/proc/self/clear_refs").open("w").close()
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    _, few, every = got["runs"]  # the first run warms up
    assert (few["frames"], every["frames"]) == (4, num_frames)
    full = width * height * 4  # one decoded frame as a Pillow RGB image
    small = got["target"][0] * got["target"][1] * 4
    mib = 2**20
    print(
        f"peak RSS added: {few['added'] / mib:.1f} MiB for 4 frames, "
        f"{every['added'] / mib:.1f} MiB for {num_frames} ({full / mib:.0f} MiB a full frame)"
    )
    # Both runs decode the stream up to about the same frame, so the decoder's own buffers (a
    # frame per decoding thread: more on more cores) cost both the same. Each further sampled
    # frame may cost its small image and its share of the tower's input; holding them at full
    # size would cost 20 full frames (320 MiB here).
    extra = num_frames - 4
    budget = 2 * full + extra * small + 2 * (every["pixel_bytes"] - few["pixel_bytes"])
    grown = every["added"] - few["added"]
    assert grown < budget, (
        f"sampling {extra} more frames of {width}x{height} added {grown / mib:.1f} MiB more "
        f"peak RSS; the bound is {budget / mib:.1f} MiB (full size: {extra * full / mib:.0f} MiB)"
    )


def test_decoded_frames_are_already_at_the_target_size(monkeypatch):
    width, height = 1280, 720
    data = make_smooth_video(8, 2, width, height)
    held: list[tuple[int, int]] = []
    decode = containers.decode_frames

    def spy(*args, **kwargs):
        frames = decode(*args, **kwargs)
        held.extend(frame.size for frame in frames)
        return frames

    monkeypatch.setattr(containers, "decode_frames", spy)
    out = processor().preprocess(MediaInput("video", video=data))
    _, gh, gw = out.grid.grid_thw
    assert (gw * 14, gh * 14) != (width, height)
    assert held == [(gw * 14, gh * 14)] * 8


def encoded_frames(data: bytes) -> list[bytes]:
    """Every frame of the container, decoded independently and stored losslessly (BMP)."""
    out = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            buf = io.BytesIO()
            Image.fromarray(frame.to_ndarray(format="rgb24")).save(buf, "BMP")
            out.append(buf.getvalue())
    return out


@pytest.mark.parametrize(("width", "height"), [(1280, 720), (600, 1000), (40, 40)])
def test_pixels_equal_frames_resized_after_decoding(width, height):
    """Resizing each frame as it is decoded gives the pixels of resizing the full-size frames
    afterwards (`process_video` on the same frames, losslessly stored), whether the frames
    shrink (the first two) or grow to min_pixels (the last)."""
    data = make_smooth_video(8, 2, width, height)
    proc = processor()
    got = proc.preprocess(MediaInput("video", video=data))
    frames = encoded_frames(data)
    indices = got.grid.video_metadata.frames_indices
    want = proc.process_video([frames[i] for i in indices], got.grid.video_metadata.sampled_fps)
    assert got.grid.grid_thw == want.grid.grid_thw
    assert got.pixel_values.equal(want.pixel_values)
