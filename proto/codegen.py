"""Generate the Python gRPC code for the kvswitch.v1 protos.

Run from the repository root (or via ``make proto``)::

    python proto/codegen.py

This compiles every ``proto/kvswitch/v1/*.proto`` with ``grpc_tools.protoc``
(the pinned grpcio-tools from the ``dev`` extra) and writes ``*_pb2.py``,
``*_pb2.pyi`` and ``*_pb2_grpc.py`` into ``kvswitch/v1/``. The generated files
are committed as-is and never edited by hand; ``tests/test_proto.py`` fails
when they drift from what this script produces.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PACKAGE_DIR = Path("kvswitch") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class CodegenError(RuntimeError):
    """protoc failed to compile the protos."""


def proto_files() -> list[Path]:
    """Every .proto under proto/kvswitch/v1, sorted, relative to proto/."""
    files = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise CodegenError(f"no .proto files found under {PROTO_ROOT / PACKAGE_DIR}")
    return [f.relative_to(PROTO_ROOT) for f in files]


def expected_outputs(out_dir: Path) -> list[Path]:
    """The files `generate` writes into `out_dir` for the current protos."""
    return [
        out_dir / proto.parent / (proto.stem + suffix)
        for proto in proto_files()
        for suffix in GENERATED_SUFFIXES
    ]


def generate(out_dir: Path) -> list[Path]:
    """Compile all kvswitch.v1 protos into `out_dir` and return the written files.

    Output lands in ``out_dir/kvswitch/v1/``. Raises `CodegenError` if protoc
    reports an error (protoc prints the details on stderr).
    """
    from grpc_tools import protoc  # dev dependency; imported lazily

    out_dir = Path(out_dir)
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    protos = proto_files()
    args = [
        "grpc_tools.protoc",
        f"-I{well_known}",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        # Absolute paths under an -I root; protoc names them relative to it
        # ("kvswitch/v1/common.proto"), so the output is the same from any cwd.
        *(str(PROTO_ROOT / p) for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise CodegenError(
            f"grpc_tools.protoc exited with status {rc} (see its errors above); "
            f"command: {' '.join(args)}"
        )
    written = expected_outputs(out_dir)
    missing = [p for p in written if not p.is_file()]
    if missing:
        raise CodegenError(f"protoc succeeded but did not write: {[str(p) for p in missing]}")
    return written


def stale_outputs(out_dir: Path) -> list[Path]:
    """Generated-looking files in ``out_dir/kvswitch/v1`` whose .proto is gone."""
    expected = set(expected_outputs(out_dir))
    pkg = out_dir / PACKAGE_DIR
    found = {p for suffix in GENERATED_SUFFIXES for p in pkg.glob("*" + suffix)}
    return sorted(found - expected)


def main() -> int:
    for path in stale_outputs(REPO_ROOT):
        path.unlink()
        print(f"removed stale {path.relative_to(REPO_ROOT)}")
    for path in generate(REPO_ROOT):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
