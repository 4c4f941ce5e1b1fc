"""Regenerates the Python gRPC code in specsplit/v1 from protos/ (one command).

    python -m specsplit.protogen            # write specsplit/v1/*_pb2*.py
    python -m specsplit.protogen --check    # exit 1 when the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PACKAGE = ROOT / "specsplit" / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency, only needed to regenerate

    protos = sorted(PROTO_DIR.glob("specsplit/v1/*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_root / "specsplit" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if args.check:
            stale = [f.name for f in fresh if not (OUT_PACKAGE / f.name).exists()
                     or not filecmp.cmp(f, OUT_PACKAGE / f.name, shallow=False)]
            extra = {p.name for p in OUT_PACKAGE.glob("*_pb2*.py*")} - {f.name for f in fresh}
            if stale or extra:
                print(f"stale generated code: {sorted(stale) + sorted(extra)}; run python -m specsplit.protogen")
                return 1
            print("generated code is up to date")
            return 0
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        for old in OUT_PACKAGE.glob("*_pb2*.py*"):
            old.unlink()
        for f in fresh:
            (OUT_PACKAGE / f.name).write_bytes(f.read_bytes())
        (OUT_PACKAGE / "__init__.py").touch()
        print(f"wrote {len(fresh)} files to {OUT_PACKAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
