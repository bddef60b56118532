"""The committed gRPC stubs must be exactly what the .proto generates."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_committed_stubs_match_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for fresh in gen.generate(tmp_path):
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run tools/gen_proto.py"
        assert committed.read_text() == fresh.read_text(), \
            f"{committed.relative_to(ROOT)} is stale: run `.venv/bin/python tools/gen_proto.py`"
