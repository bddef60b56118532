"""A server that answers "busy" is alive: the ring keeps its same-host client, whose follower
(localread.py) is costly to open (the server's Info, a flush for followers, RocksDB opening
every table file), instead of replacing it as it does a server that fails. Real daemon."""
import hashlib
import socket
import time

from cacheserver import wire
from cacheserver.client import readpath, server_client
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, stalled_put, wait_until


def _admitted(c: ServerClient, ids: list[bytes]) -> bool:
    try:
        c.lookup(ids)
        return True
    except wire.RemoteError:  # busy
        return False


def test_a_busy_server_keeps_its_same_host_follower(tmp_path, monkeypatch):
    opened = []

    class Counted(server_client.LocalReader):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            opened.append(self)

    monkeypatch.setattr(server_client, "LocalReader", Counted)
    # the follower kept whatever it costs (readpath.py), so only the busy answer could drop it
    monkeypatch.setattr(readpath, "MIN_FOLLOWER_S", float("inf"))
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--max-batch-size", "64MiB",
                    "--max-inflight-bytes", "8MiB").start()
    small = [(hashlib.sha256(bytes([i])).digest(), bytes([i]) * 1000) for i in range(16)]
    ids = [k for k, _ in small]
    big = [(hashlib.sha256(v).digest(), v) for v in (bytes([i]) * (4 << 20) for i in range(3))]
    try:
        with RingClient([s.address], down_backoff=0.2, timeout=20) as ring, \
                ServerClient(s.address, local_read=False, timeout=20) as probe:
            assert ring.put(small) == len(small)
            wait_until(lambda: [bytes(v) for v in ring.get(ids) if v is not None] == [v for _, v in small],
                       "the values served")
            client = ring.clients[s.address]
            assert client.transport == "local" and len(opened) == 1
            def connect() -> socket.socket:
                k = socket.socket(socket.AF_UNIX)
                k.connect(probe.info().unix_socket)
                return k
            with stalled_put(connect, lambda: not _admitted(probe, ids)):
                unsent: list[int] = []
                assert ring.put(big, unsent=unsent) == 0 and unsent == [0, 1, 2]  # answered busy
                assert ring.errors == 1 and s.address in ring._answering
            wait_until(lambda: _admitted(probe, ids), "the budget free again")
            time.sleep(0.3)  # the busy server's back-off (down_backoff) is over
            assert [bytes(v) for v in ring.get(ids)] == [v for _, v in small]
            # before: a new client, which read the server's Info again and opened a second follower
            assert ring.clients[s.address] is client and client.transport == "local"
            assert len(opened) == 1
    finally:
        assert s.stop() == 0


def test_a_replaced_value_reaches_a_follower_that_never_misses(tmp_path):
    """Before: catch-ups came only with misses, so under all-hit reads the follower served the
    value a replace put (a poisoned value's repair) had overwritten, for as long as it ran."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    k, old, new = hashlib.sha256(b"k").digest(), b"1" * 1000, b"2" * 1000
    try:
        with ServerClient(s.address) as a, ServerClient(s.address, local_read=False) as b:
            b.put([(k, old)])

            def follower_has(value: bytes) -> bool:
                assert bytes(a.get([k])[0]) in (old, new)
                got = a._local.read([k])[0] if a._local is not None else None
                return got is not None and bytes(got) == value

            wait_until(lambda: follower_has(old), "the follower sees the first value")
            assert a.transport == "local"
            b.put([(k, new)], replace=True)
            # served inline until flushed (QUIET_S), then from the follower: the new value
            wait_until(lambda: follower_has(new), "the follower sees the replaced value", timeout=20)
            assert bytes(a.get([k])[0]) == new
    finally:
        assert s.stop() == 0
