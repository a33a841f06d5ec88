"""Regenerate the committed gRPC stubs of proto/src/pagefleet/proto/*.proto (after editing one).

protoc derives import paths from the .proto's path below its include root, so each file is
compiled from a temporary tree laid out as pagefleet/proto/NAME.proto: the stubs then import
each other as `pagefleet.proto.NAME_pb2`, which is where the editable and wheel installs put them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "src" / "pagefleet" / "proto"


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Write NAME_pb2.py and NAME_pb2_grpc.py for every proto_dir/*.proto into out_dir."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        dst = Path(tmp) / "out"
        package = src / "pagefleet" / "proto"
        package.mkdir(parents=True)
        dst.mkdir()
        protos = sorted(proto_dir.glob("*.proto"))
        for proto in protos:
            shutil.copyfile(proto, package / proto.name)
        # protoc's own well-known types (google/protobuf/*.proto) ship inside grpc_tools.
        include = Path(protoc.__file__).parent / "_proto"
        for proto in protos:
            args = [
                "grpc_tools.protoc",
                f"-I{src}",
                f"-I{include}",
                f"--python_out={dst}",
                f"--grpc_python_out={dst}",
                f"pagefleet/proto/{proto.name}",
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
        for stub in sorted((dst / "pagefleet" / "proto").glob("*.py")):
            target = out_dir / stub.name
            shutil.copyfile(stub, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=PROTO_DIR, help="where to write the stubs (default: proto/)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
