"""Generate the Python stubs for every .proto under protos/.

    python protos/codegen.py          # regenerate in place
    python protos/codegen.py --check  # exit 1 if the checked-in stubs drift

Protos are compiled with the repository root as the include path, so a
generated module imports its siblings as ``protos.tandem.v1.x_pb2`` and works
from any working directory once the repository is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def expected_outputs() -> list[Path]:
    """Generated paths, relative to the repository root."""
    out = []
    for proto in proto_files():
        stem = proto.relative_to(ROOT).with_suffix("")
        out += [stem.with_name(stem.name + s) for s in SUFFIXES]
    return out


def check() -> list[str]:
    """Paths whose checked-in content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drift = []
        for rel in expected_outputs():
            fresh, current = Path(tmp) / rel, ROOT / rel
            if not current.exists() or not filecmp.cmp(fresh, current, shallow=False):
                drift.append(str(rel))
        return drift


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs are stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(ROOT)
        return 0
    drift = check()
    if drift:
        print(
            "protos: generated stubs are out of date: "
            + ", ".join(drift)
            + "\nrun: python protos/codegen.py",
            file=sys.stderr,
        )
        return 1
    print(f"protos: {len(expected_outputs())} generated files up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
