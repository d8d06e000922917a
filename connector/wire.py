"""The embedding wire format: one Redis value per entry, a fixed 64-byte header + raw bytes.

    offset size  field
    0      4     magic b"EPDE"
    4      1     format version (1)
    5      1     dtype code (1 float32, 2 float16, 3 bfloat16: the numbers of epd.v1.DType)
    6      1     ndim (1..8)
    7      1     reserved (0)
    8      8     payload length in bytes (little endian)
    16     8     xxh3-64 of the payload
    24     4*8   shape, one uint32 per dimension (unused ones 0); the last one is the width
    56     8     reserved (0)
    64     ...   the tensor's bytes, C order, little endian

bf16 stays bf16. Decoding is zero-copy: the tensor is a view of the fetched value (bytes, or
the buffer connector/resp.py received it into). No pickle.
NOTE: xxh3 (about 50 GB/s here) rather than zlib.crc32 (about 4 GB/s): a CRC would cost a
quarter of a GET's time on a 4 MiB entry.
"""

from __future__ import annotations

import struct
import sys
import warnings

import torch
import xxhash

MAGIC = b"EPDE"
VERSION = 1
HEADER_BYTES = 64
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBQQ")  # magic, version, dtype, ndim, reserved, nbytes, checksum
_SHAPE = struct.Struct(f"<{MAX_NDIM}I")

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

assert sys.byteorder == "little", "the wire format is little endian"

# NOTE: decoded tensors view immutable bytes; torch warns on every such view that it cannot mark
# it read-only. The contract (never write into a fetched embedding) is ours to keep, and a
# per-call catch_warnings would cost more than the checksum.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class WireError(ValueError):
    """A value that is not a valid entry (bad magic, version, dtype, length or checksum)."""


def payload_of(tensor: torch.Tensor) -> tuple[memoryview, bytes]:
    """A tensor's bytes (C order) and its packed shape (MAX_NDIM uint32s, unused ones 0): what
    both value formats (this one and connector/kv.py's) carry after their header."""
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"cannot store dtype {tensor.dtype}; supported: float32, float16, bfloat16")
    if not 1 <= tensor.dim() <= MAX_NDIM:
        raise ValueError(f"cannot store a {tensor.dim()}-d tensor (1..{MAX_NDIM} dimensions)")
    payload = memoryview(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")
    return payload, _SHAPE.pack(*tensor.shape, *[0] * (MAX_NDIM - tensor.dim()))


def checked_view(
    value: bytes | memoryview,
    header_bytes: int,
    shape_at: int,
    code: int,
    ndim: int,
    nbytes: int,
    checksum: int,
) -> torch.Tensor:
    """The payload after a `header_bytes` header (its shape packed at `shape_at`) as a tensor
    viewing `value` (read-only by contract: never write into it), once the header's dtype
    code, ndim, length and checksum are checked against it; WireError otherwise."""
    if code not in CODE_DTYPES:
        raise WireError(f"unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM:
        raise WireError(f"bad ndim {ndim}")
    shape = _SHAPE.unpack_from(value, shape_at)[:ndim]
    dtype = CODE_DTYPES[code]
    expected = dtype.itemsize
    for dim in shape:
        expected *= dim
    if nbytes != expected or len(value) != header_bytes + nbytes:
        raise WireError(
            f"length mismatch: header says {nbytes} payload bytes for shape {tuple(shape)} "
            f"{dtype}, value holds {len(value) - header_bytes}"
        )
    if xxhash.xxh3_64_intdigest(memoryview(value)[header_bytes:]) != checksum:
        raise WireError("checksum mismatch")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # The module's warning filter silences torch's "not writable" warning (given once per
    # process): a catch_warnings per call resets the interpreter's warning state and cost
    # more than the checksum.
    flat = torch.frombuffer(value, dtype=dtype, offset=header_bytes, count=nbytes // dtype.itemsize)
    return flat.view(shape)


def encode(tensor: torch.Tensor) -> bytes:
    """Header + payload of a CPU tensor, as one bytes object (one copy of the payload)."""
    payload, shape = payload_of(tensor)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        DTYPE_CODES[tensor.dtype],
        tensor.dim(),
        0,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload),
    )
    return b"".join(((fixed + shape).ljust(HEADER_BYTES, b"\0"), payload))


def decode(value: bytes | memoryview) -> torch.Tensor:
    """The tensor in `value`, viewing its bytes (read-only by contract: never write into it)."""
    if len(value) < HEADER_BYTES:
        raise WireError(
            f"value of {len(value)} bytes is shorter than the {HEADER_BYTES}-byte header"
        )
    magic, version, code, ndim, _, nbytes, checksum = _FIXED.unpack_from(value)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError(f"format version {version}, this build reads {VERSION}")
    return checked_view(value, HEADER_BYTES, _FIXED.size, code, ndim, nbytes, checksum)
