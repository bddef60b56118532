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


def test_the_shared_words_have_the_proto_wire_values():
    from cacheserver.proto import cache_pb2 as pb
    from cacheserver.proto import manager_pb2 as mpb
    from cacheserver.vocab import CacheMode, Option

    assert {m.code: m.name for m in CacheMode} == {
        v.number: v.name.removeprefix("CACHE_MODE_") for v in pb.CacheMode.DESCRIPTOR.values}
    assert {o.code: o.name for o in Option} == {
        v.number: v.name.removeprefix("CACHE_OPTION_") for v in mpb.CacheOption.DESCRIPTOR.values}
    for m in CacheMode:
        assert CacheMode.of_code(m.code) is m
    with pytest.raises(ValueError, match="unknown cache mode 7"):
        CacheMode.of_code(7)
    assert Option.of_code(9, Option.NONE) is Option.NONE
