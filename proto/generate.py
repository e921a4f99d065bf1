"""Regenerate the Python stubs of the kubelet APIs from proto/ into agent/api/.

    python proto/generate.py            # writes agent/api/**/api_pb2*.py(i)
    python proto/generate.py --out DIR  # writes under DIR instead (the tests compare the two)

The protos are compiled under the virtual path ``agent/api/`` so the generated modules import each other as
``agent.api...`` and the files, all named api.proto, get distinct names in the descriptor pool. The stubs are
committed, so installing Tessera needs no code generation; ``grpcio-tools`` is pinned in the test extras so
that regenerating gives byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "drahealth/v1alpha1/api.proto",
    "drahealth/v1/api.proto",
)
VIRTUAL_ROOT = "agent/api"


def generate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    arguments = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_ROOT}={ROOT / 'proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(f"{VIRTUAL_ROOT}/{proto}" for proto in PROTOS),
    ]
    if protoc.main(arguments) != 0:
        raise RuntimeError("protoc failed")
    return sorted(path for path in out.joinpath(VIRTUAL_ROOT).rglob("api_pb2*") if path.suffix in {".py", ".pyi"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
