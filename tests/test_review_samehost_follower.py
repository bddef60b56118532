"""A same-host client that a busy server refused once keeps its fast paths: the follower
(localread.py) is opened later, and the Unix socket is taken once the server answers its
ping. Before, one busy answer (--max-inflight-bytes, --max-connections) cost the client its
follower, or its socket and follower, for its whole life. Real daemons."""
import hashlib
import socket

import pytest

from cacheserver import ops, wire
from cacheserver.client import readpath, server_client
from cacheserver.client.readpath import OpenRetry
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, stalled_put, wait_until

ITEMS = [(hashlib.sha256(bytes([i])).digest(), bytes([i]) * 1000) for i in range(8)]
IDS = [k for k, _ in ITEMS]
VALUES = [v for _, v in ITEMS]


def _busy(probe: ServerClient) -> bool:
    try:
        probe.lookup(IDS)
        return False
    except wire.RemoteError as e:
        return e.status == wire.UNAVAILABLE


def _stall(probe: ServerClient) -> socket.socket:
    """A put whose body never comes: its declared 60 MiB stay admitted (--max-inflight-bytes),
    and the server answers busy."""
    def connect() -> socket.socket:
        k = socket.socket(socket.AF_UNIX)
        k.connect(probe.info().unix_socket)
        return k
    return stalled_put(connect, lambda: _busy(probe), tries=20, wait=1)


def _served(c: ServerClient) -> bool:
    try:
        got = c.get(IDS)
    except (wire.RemoteError, OSError):  # busy still, or the slot not yet given back
        return False
    return [bytes(v) for v in got] == VALUES


def _server(tmp_path, *extra: str):
    return cacheserver(str(tmp_path / "d"), "256MB", 0, "--max-inflight-bytes", "8MiB", *extra).start()


def test_a_busy_answer_to_open_follower_leaves_the_follower_for_later(tmp_path, monkeypatch):
    s = _server(tmp_path)
    stalls: list[socket.socket] = []
    try:
        with ServerClient(s.address, local_read=False, timeout=20) as probe:
            probe.put(ITEMS)
            real_ping = ServerClient._ping

            def ping_then_stall(self, sock):  # busy from just after the client's ping on
                instance = real_ping(self, sock)
                stalls.append(_stall(probe))
                return instance

            monkeypatch.setattr(ServerClient, "_ping", ping_then_stall)
            asks = []
            real_new = ServerClient._new_follower

            def counted(self, db_path):
                asks.append(db_path)
                return real_new(self, db_path)

            monkeypatch.setattr(ServerClient, "_new_follower", counted)
            with ServerClient(s.address, timeout=20) as c:
                c.resolve()  # OPEN_FOLLOWER answered busy
                monkeypatch.setattr(ServerClient, "_ping", real_ping)
                assert c.transport == "unix" and c._local is None and len(asks) == 1
                for _ in range(5):  # refused themselves; no OPEN_FOLLOWER asked on each (a back-off)
                    assert not _served(c)
                assert len(asks) <= 2
                stalls.pop().close()
                wait_until(lambda: not _busy(probe), "the budget free again")
                # before: _db_path was never set, so no follower ever opened
                wait_until(lambda: _served(c) and c.transport == "local", "the follower opened", timeout=10)
                wait_until(lambda: [v and bytes(v) for v in c._local.read(IDS)] == VALUES,
                           "the values flushed, read from the follower")
    finally:
        for k in stalls:
            k.close()
        assert s.stop() == 0


def test_a_busy_answer_to_reopening_the_follower_leaves_it_for_later(tmp_path, monkeypatch):
    """The follower dropped while the socket paid (readpath.py) is reopened once the hold is
    over; before, a busy answer then set _db_path to None: no follower ever again."""
    monkeypatch.setattr(readpath, "MIN_HOLD", 0.3)
    s = _server(tmp_path)
    try:
        with ServerClient(s.address, local_read=False, timeout=20) as probe, \
                ServerClient(s.address, timeout=20) as c:
            probe.put(ITEMS)
            wait_until(lambda: _served(c) and c._local is not None, "a follower")
            c.paths.follower(1.0)  # a window in which the follower cost far more than it read
            assert c.paths.decide() == readpath.REMOTE
            assert _served(c) and c._local is None  # dropped for the hold
            with _stall(probe):
                wait_until(lambda: c.paths.use_local(), "the hold over")
                assert not _served(c)  # reopening it was answered busy, as the get was
                assert c._local is None
            wait_until(lambda: not _busy(probe), "the budget free again")
            wait_until(lambda: _served(c) and c._local is not None, "the follower reopened", timeout=10)
    finally:
        assert s.stop() == 0


def test_a_busy_answer_to_the_ping_does_not_keep_the_client_on_tcp(tmp_path):
    s = _server(tmp_path)
    try:
        with ServerClient(s.address, local_read=False, timeout=20) as probe:
            probe.put(ITEMS)
            with _stall(probe):
                c = ServerClient(s.address, timeout=20)
                with pytest.raises(wire.RemoteError, match="server busy"):
                    c.lookup(IDS)
                assert c.transport == "unresolved"  # before: "tcp", for good
            wait_until(lambda: not _busy(probe), "the budget free again")
            with c:
                assert _served(c) and c.transport == "local"
    finally:
        assert s.stop() == 0


def test_a_connection_refused_past_max_connections_does_not_keep_the_client_on_tcp(tmp_path):
    s = _server(tmp_path, "--max-connections", "1")
    try:
        with ServerClient(s.address, local_read=False, use_dataplane=False, timeout=20) as writer:
            writer.put(ITEMS)  # over gRPC: no data-plane connection held
            held = socket.socket(socket.AF_UNIX)
            held.connect(writer.info().unix_socket)
            with held, ServerClient(s.address, timeout=20) as c:
                held.sendall(wire.pack_header(ops.PING.code, 0, 0, 0))
                wire.recv_exact(held, wire.HEADER.size)  # served: it holds the one connection
                with pytest.raises((wire.RemoteError, OSError)):
                    c.lookup(IDS)
                assert c.transport == "unresolved"  # before: "tcp", for good
                held.close()
                wait_until(lambda: _served(c), "the connection given back", timeout=10)
                assert c.transport == "local"
    finally:
        assert s.stop() == 0


def test_a_follower_rocksdb_cannot_open_is_not_tried_again(tmp_path, monkeypatch):
    opens = []

    class Elsewhere(server_client.LocalReader):  # a real RocksDB failure: no store there
        def __init__(self, db_path: str, plain: bool = False) -> None:
            opens.append(db_path)
            super().__init__(str(tmp_path / "no-store"), plain)

    monkeypatch.setattr(server_client, "LocalReader", Elsewhere)
    s = _server(tmp_path)
    try:
        with ServerClient(s.address, timeout=20) as c:
            c.put(ITEMS)
            for _ in range(3):
                assert _served(c)
            assert len(opens) == 1 and c._db_path is None and c.transport == "unix"
    finally:
        assert s.stop() == 0


def test_open_retry_backs_off_while_refused_and_starts_over_once_opened(monkeypatch):
    now = [100.0]
    r = OpenRetry(clock=lambda: now[0])
    assert r.due()
    waits = [r.refused() for _ in range(10)]
    assert waits[:3] == [readpath.RETRY_FIRST_S, 2 * readpath.RETRY_FIRST_S, 4 * readpath.RETRY_FIRST_S]
    assert max(waits) == readpath.RETRY_MAX_S and not r.due()
    now[0] += readpath.RETRY_MAX_S
    assert r.due()
    r.opened()
    assert r.due() and r.refused() == readpath.RETRY_FIRST_S
