"""A same-host follower (cacheserver/client/localread.py) whose view of the store files is
older than the flush that wrote a replacing put out must not serve the value that put
replaced once the server answers "read it from your files" (GET_LOCAL, size LOCAL).

Before: the follower caught up only on a miss, or once its last catch-up was MAX_STALE_S
(1 s) old. A replaced id is no miss (the old value is still in the follower's view), so a
follower that last caught up before the replace served the old value as a hit until then:
a sealed store's client found it poisoned and repaired it again, a plain (embedded) store's
served a value its owner had overwritten. One way to get such a view is a follower opened
while the flusher wrote the replace out (RocksDB skips a log deleted under its open, the old
value's logged delete with it): a race on RocksDB's own timing that no test here can force.
The tests below make the same view deterministically (the follower's last catch-up before
the replace, the MAX_STALE_S backstop out of the way) with real server processes."""
import hashlib
import socket

import pytest

from cacheserver import ops, wire
from cacheserver.client import localread
from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import FEATURE_LOCAL_GEN
from procs import cacheserver, wait_until, without_features
from test_hardening_net import _data_addr

K = hashlib.sha256(b"k").digest()
OLD, NEW = b"1" * 1000, b"2" * 1000


def _on_file(probe: ServerClient, key: bytes) -> bool:
    """Whether the server answers `key` as one to read from the store files (flushed), asked as a
    client from before FEATURE_LOCAL_GEN asks: the answer must parse exactly as before."""
    body = probe.ask(ops.GET_LOCAL, [key], inline=True)
    return ops.values_of(1, body)[1] == [0]


def _follower_has(c: ServerClient, value: bytes) -> bool:
    assert bytes(c.get([K])[0]) in (OLD, NEW)
    local = c._local
    got = local.read([K])[0] if local is not None else None
    return got is not None and bytes(got) == value


def _replaced_then_flushed(writer: ServerClient, probe: ServerClient) -> None:
    writer.put([(K, NEW)], replace=True)
    # --durability cache: inline while only in the memtable, then (flusher.py) on file: the moment the
    # follower is told to read it; process: on file (in the log) at once
    wait_until(lambda: _on_file(probe, K), "the server flushed the replacing value", timeout=30)


def _serves_the_replacing_value(monkeypatch, tmp_path, older_server: bool, durability: str = "cache") -> None:
    monkeypatch.setattr(localread, "MAX_STALE_S", 3600.0)  # only the answer's generation may start a catch-up
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--durability", durability).start()
    try:
        with ServerClient(s.address) as a, ServerClient(s.address, local_read=False) as w, \
                ServerClient(s.address, local_read=False) as probe:
            if older_server:
                without_features(a, FEATURE_LOCAL_GEN)
            w.put([(K, OLD)])
            wait_until(lambda: _follower_has(a, OLD), "the follower reads the first value from its files")
            assert a.transport == "local"
            _replaced_then_flushed(w, probe)
            got = bytes(a.get([K])[0])
            if older_server:  # nothing tells it: the old value until MAX_STALE_S (1 s in use), as before
                assert got == OLD
                monkeypatch.setattr(localread, "MAX_STALE_S", 0.0)
                assert bytes(a.get([K])[0]) == NEW
            else:
                assert got == NEW, "the follower served the value a replace put had overwritten"
                assert _follower_has(a, NEW)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_a_follower_older_than_a_replace_s_flush_catches_up_before_it_serves(tmp_path, monkeypatch, durability):
    _serves_the_replacing_value(monkeypatch, tmp_path, older_server=False, durability=durability)


def test_a_client_of_a_server_without_the_generation_reads_as_before(tmp_path, monkeypatch):
    """The generation is asked for only of a server that announces it (ServerClient.supports); of
    one that does not, gets go on as before (the older client's answer format: _on_file)."""
    _serves_the_replacing_value(monkeypatch, tmp_path, older_server=True)


def test_a_fresh_follower_catches_up_once_at_its_first_answer(tmp_path):
    """A follower opened while the flusher wrote a replace out may lack both the flush and the
    logged delete of the old value: its view is known to cover no generation until it has caught
    up after an answer, so its first read from the files comes after one catch-up."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w, ServerClient(s.address, local_read=False) as probe:
            w.put([(K, OLD)])
            wait_until(lambda: _on_file(probe, K), "the server flushed the value")
            with ServerClient(s.address) as a:
                assert a.lookup([K]) == b"\x01"  # resolved: the follower opens
                local = a._local
                assert local is not None and a.transport == "local"
                assert local.view is None  # opened: no generation known to be in its view
                assert bytes(a.get([K])[0]) == OLD
                view = local.view
                assert view is not None  # caught up after the answer that reported the generation
                assert bytes(a.get([K])[0]) == OLD
                assert local.view == view  # nothing new: no catch-up (one compare per batch)
    finally:
        assert s.stop() == 0


def test_generation_without_inline_is_refused_naming_both_flags(tmp_path):
    """A GET_LOCAL frame with flag GENERATION but not INLINE (no client of ours sends one:
    GetLocal.frame refuses it) gets a bad-request answer naming both flags; the connection stays
    usable, and the same ids asked with both flags get the generation and the values."""
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--unix-socket", "off").start()
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put([(K, OLD)])
        with socket.create_connection(_data_addr(s.address), timeout=10) as k:
            k.sendall(wire.pack_header(ops.GET_LOCAL.code, 0, 1, len(K), ops.FLAG_GENERATION) + K)
            status, aux_len, _, _ = wire.unpack_header(wire.recv_exact(k, wire.HEADER.size))
            assert status == wire.BAD_REQUEST
            assert "GENERATION (32) is served only with flag INLINE (8)" in bytes(wire.recv_exact(k, aux_len)).decode()
            k.sendall(wire.pack_header(ops.GET_LOCAL.code, 0, 1, len(K), ops.FLAG_GENERATION | ops.FLAG_INLINE) + K)
            status, _, count, body_len = wire.unpack_header(wire.recv_exact(k, wire.HEADER.size))
            body = bytes(wire.recv_exact(k, body_len))
            assert status == wire.OK and count == 1
            ops.generation_of(body)
            values, local = ops.values_of(count, body, ops.GENERATION.size)
            assert local == [0] or bytes(values[0]) == OLD  # on file, or still in the memtable
        with pytest.raises(ValueError, match="generation is answered only with inline"):
            ops.GET_LOCAL.frame([K], generation=True)
    finally:
        assert s.stop() == 0
