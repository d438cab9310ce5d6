"""Regenerate the control service's Python code from control.proto (needs grpcio-tools, pinned).

    python -m adloco.protocol.control.gen            # rewrite control_pb2{.py,.pyi,_grpc.py} here
    python -m adloco.protocol.control.gen --out DIR  # write them to DIR instead (the drift test)

protoc sees the file under the virtual path adloco/protocol/control/control.proto, so the
descriptor is registered in protobuf's process-wide pool under a name no other library's
`control.proto` can collide with (hivemind registers its own files there). The generated code is
untyped, so each file gets a `# mypy: ignore-errors` first line (`mypy --strict` covers the rest), and
the service module imports its messages relatively, as the package's own modules do.
The output depends on the grpcio-tools version (it embeds its protoc's version and checks the
protobuf runtime against it at import), hence the pin; protoc runs in a subprocess so this module
imports only the standard library.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "control.proto"
VIRTUAL_DIR = "adloco/protocol/control"
PACKAGE = VIRTUAL_DIR.replace("/", ".")
GRPC_TOOLS_VERSION = "1.85.1"
OUTPUTS = ("control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py")
HEADER = "# mypy: ignore-errors\n"


def generate(out_dir: Path) -> list[Path]:
    """Write the generated files into `out_dir`; raises RuntimeError if protoc is missing or fails."""
    try:
        installed = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"grpcio-tools is not installed (pip install grpcio-tools=={GRPC_TOOLS_VERSION})"
        ) from None
    if installed != GRPC_TOOLS_VERSION:
        raise RuntimeError(
            f"grpcio-tools {installed} is installed; the checked-in code needs {GRPC_TOOLS_VERSION}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        flags = [f"--{kind}_out={tmp}" for kind in ("python", "pyi", "grpc_python")]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"--proto_path={VIRTUAL_DIR}={PROTO.parent}",
                *flags,
                f"{VIRTUAL_DIR}/{PROTO.name}",
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed: {result.stderr.strip()}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            text = (Path(tmp) / VIRTUAL_DIR / name).read_text()
            # protoc writes the absolute import; inside the package we import relatively.
            text = text.replace(f"from {PACKAGE} import control_pb2", "from . import control_pb2")
            (out_dir / name).write_text(HEADER + text)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gen_control", description="Regenerate the control service code.")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder")
    args = parser.parse_args(argv)
    try:
        for path in generate(args.out):
            print(path)
    except RuntimeError as e:
        print(f"gen_control: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
