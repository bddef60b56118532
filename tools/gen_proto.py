#!/usr/bin/env python3
"""Regenerate the committed gRPC stubs from cacheserver/proto/*.proto.

Stubs are committed so a clean clone needs no code generation; the test
tests/test_proto_stubs.py regenerates them into a temp dir and fails if the
committed files differ. Run this after editing a .proto:
    .venv/bin/python tools/gen_proto.py
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "cacheserver" / "proto").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        rel = proto.relative_to(ROOT)
        # grpc_tools (dev extra) in a process of its own: its bundled libprotobuf crashes
        # in a process that has loaded TensorFlow's (the test suite's, once tf tests ran).
        r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
                            f"--grpc_python_out={out_dir}", str(rel)], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {r.returncode}): {r.stderr.strip()}")
    return [out_dir / p.relative_to(ROOT).parent / f"{p.stem}{suffix}.py"
            for p in PROTOS for suffix in ("_pb2", "_pb2_grpc")]


if __name__ == "__main__":
    files = generate(ROOT)
    print("\n".join(str(f.relative_to(ROOT)) for f in files), file=sys.stderr)
