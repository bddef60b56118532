"""Answers being sent count against --max-inflight-bytes as request bodies do, and a
TLS connection past --max-connections is told why; real daemons on loopback."""
import hashlib
import os
import socket

import pytest

from cacheserver import ops, wire
from cacheserver.client.server_client import ServerClient
from cacheserver.tls import TlsFiles
from procs import cacheserver, free_port, make_certs, wait_until


def _busy(call) -> str:
    try:
        call()
    except wire.RemoteError as e:
        assert e.status == wire.UNAVAILABLE, e
        return str(e)
    return ""


def test_answers_being_sent_count_against_the_inflight_budget(tmp_path):
    """Before: a get's answer was counted nowhere, so --max-connections readers that take
    their answers slowly held that many whole answers (up to --max-batch-size each)."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--max-batch-size", "64MiB",
                    "--max-inflight-bytes", "32MiB", "--request-timeout", "30").start()
    # the held answer is larger than a socket's send buffer can take (tcp_wmem's max is 4 MiB
    # by default, more where tuned), so it is still being sent while the test runs
    values = [bytes([0]) * (24 << 20), bytes([1]) * (12 << 20)]
    ids = [hashlib.sha256(v).digest() for v in values]
    try:
        with ServerClient(s.address, local_read=False, timeout=20) as c:
            assert c.put(list(zip(ids, values))) == (2, 0, 0)
            host, port = c.info().data_address.rsplit(":", 1)
            slow = socket.socket()
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
            slow.connect((host, int(port)))
            slow.sendall(wire.pack_header(ops.GET.code, 0, 1, 32) + ids[0])  # 24 MiB answer, not read
            # held once read: a get of ours racing it would have left it room for only part of
            # its value (answered a miss, nothing held)
            wait_until(lambda: c.stats().counters["get_hits"] == 1, "the slow get's value read", 30)
            small = os.urandom(12 << 20)
            item = (hashlib.sha256(small).digest(), small)
            why = _busy(lambda: c.get([ids[1]]))
            assert why.startswith("server busy: ") and "--max-inflight-bytes" in why, why
            assert "--max-inflight-bytes" in _busy(lambda: c.put([item]))  # one budget for both
            assert c.lookup(ids) == b"\1\1"  # small bodies still fit
            slow.close()  # its answer is dropped: the budget is free again
            # one get larger than the whole budget is served, alone
            got = wait_until(lambda: not _busy(lambda: c.get(ids)) and c.get(ids), "the large get served", 30)
            assert [bytes(g) for g in got] == values
            assert c.put([item])[0] == 1
            assert c.stats().counters["busy_refused"] >= 2
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls") / "certs")


@pytest.mark.parametrize("secure", [False, True], ids=["tcp", "tls"])
def test_a_connection_past_the_cap_is_told_why(tmp_path, certs, secure):
    """Before: closed with no reason under TLS (the client saw a closed connection, as from a
    broken server); under plain TCP told why, but closed with the request unread, so a client
    sending a large put had the connection reset under it and the reason lost."""
    dport = free_port()
    extra = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
             "--tls-ca", str(certs / "ca.pem")] if secure else []
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--data-listen", f"127.0.0.1:{dport}", "--unix-socket", "off",
                    "--max-connections", "2", *extra).start()
    tls = TlsFiles(str(certs / "client.pem"), str(certs / "client-key.pem"), str(certs / "ca.pem")) if secure else None
    holders = [socket.create_connection(("127.0.0.1", dport), timeout=5) for _ in range(2)]
    value = os.urandom(8 << 20)
    item = (hashlib.sha256(value).digest(), value)
    says = r"server busy: 2 data-plane connections open, limit 2 \(--max-connections\)"
    try:
        with ServerClient(s.address, tls=tls, local_read=False, prefer_unix=False, timeout=10) as c:
            wait_until(lambda: c.stats().counters["dataplane_requests"] == 0, "the server up", 30)
            for call in (lambda: c.lookup([bytes(32)]), lambda: c.put([item])):
                with pytest.raises(wire.RemoteError, match=says) as e:
                    call()
                assert e.value.status == wire.UNAVAILABLE
            for k in holders:
                k.close()
            assert wait_until(lambda: not _busy(lambda: c.lookup([bytes(32)])), "a slot free again", 30)
            assert c.put([item])[0] == 1
            assert c.transport == "tcp" and c.stats().counters["busy_refused"] >= 2
    finally:
        for k in holders:
            k.close()
        assert s.stop() == 0
