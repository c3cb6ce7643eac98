"""Regenerate the checked-in protobuf/gRPC stubs in cube/pb from proto/*.proto.

The stubs are checked in so that an install needs no protoc; tests/test_pb_stubs.py fails when
they no longer match what this script produces. Run: python -m cube.pb.generate [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PB_DIR = Path(__file__).resolve().parent
PROTO_DIR = PB_DIR.parent.parent / "proto"


def render() -> dict[str, str]:
    """Run protoc on every proto/*.proto; return {file name: text} with package-relative imports."""
    from grpc_tools import protoc  # only needed by developers regenerating stubs

    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *map(str, protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
        files = {}
        for path in sorted(Path(out).iterdir()):
            text = path.read_text()
            # protoc writes `import cube_pb2 as ...`; the stubs live inside the cube.pb package.
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            files[path.name] = text
        return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the stubs are stale")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        target = PB_DIR / name
        if not target.exists() or target.read_text() != text:
            stale.append(name)
            if not args.check:
                target.write_text(text)
    if args.check and stale:
        print(f"stale stubs in {PB_DIR}: {', '.join(stale)}; run python -m cube.pb.generate")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
