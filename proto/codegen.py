"""Generate the Python stubs for proto/epd.proto, or check that the committed ones are fresh.

    python -m proto.codegen          # regenerate proto/epd_pb2.py, .pyi and epd_pb2_grpc.py
    python -m proto.codegen --check  # exit 1 with a diff when the committed stubs are stale

Needs grpcio-tools (the `test` extra pins the version the committed stubs came from).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
SOURCES = ["proto/epd.proto"]
GENERATED = ["epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py"]


def generate(out_dir: Path) -> None:
    """Run protoc from the repository root so generated imports read `from proto import ...`."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(ROOT / s) for s in SOURCES],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see its message above)")


def check() -> list[str]:
    """Regenerate into a temporary directory; return a diff per stale file (empty: fresh)."""
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in GENERATED:
            fresh = (Path(tmp) / "proto" / name).read_text()
            path = PROTO_DIR / name
            committed = path.read_text() if path.exists() else ""
            if fresh != committed:
                diff = difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    fresh.splitlines(keepends=True),
                    f"committed/proto/{name}",
                    f"regenerated/proto/{name}",
                )
                stale.append("".join(diff) or f"proto/{name} is missing\n")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        for diff in stale:
            sys.stdout.write(diff)
        if stale:
            print("proto stubs are stale: run `python -m proto.codegen` and commit the result")
            return 1
        print("proto stubs are fresh")
        return 0
    generate(ROOT)
    print("regenerated " + ", ".join(f"proto/{n}" for n in GENERATED))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
