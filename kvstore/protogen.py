"""Generates the gRPC stubs in kvstore/_proto/ from proto/kvstore/v1/*.proto.

protoc writes imports as ``from kvstore.v1 import x_pb2``, which would collide with this
package; the stubs are flattened into ``kvstore._proto`` and their imports rewritten.
Run ``python -m kvstore.protogen`` after editing a .proto; a test fails while they are stale.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
OUT_DIR = REPO / "kvstore" / "_proto"
_IMPORT = re.compile(r"^from kvstore\.v1 import (\w+)", re.MULTILINE)


def render() -> dict[str, str]:
    """Returns {file name: text} of the stubs the current .proto files produce."""
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "kvstore" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + " ".join(protos))
        files = {}
        for path in sorted((Path(tmp) / "kvstore" / "v1").iterdir()):
            text = _IMPORT.sub(r"from kvstore._proto import \1", path.read_text())
            files[path.name] = text
    files["__init__.py"] = '"""Generated gRPC stubs; do not edit (python -m kvstore.protogen)."""\n'
    return files


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in OUT_DIR.glob("*.py*"):
        old.unlink()
    for name, text in render().items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
