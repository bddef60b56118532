"""A data-plane get's values count against --max-inflight-bytes as they are read, a group
at a time, and a get answered busy is not counted as a get; a dribbled TLS handshake is
cut off in total; real daemons on loopback."""
import contextlib
import hashlib
import os
import socket
import ssl
import time

import pytest

from cacheserver import ops, wire
from cacheserver.admission import Admission, AnswerBudget
from cacheserver.client.server_client import ServerClient
from cacheserver.dataplane import HANDSHAKE_SECONDS
from cacheserver.getbound import GROUP, bounded_get
from procs import cacheserver, free_port, make_certs, wait_until
from test_review_admission_answers import _busy

SMALL = 64 << 10


@contextlib.contextmanager
def _six_of_eight_mib_held(tmp_path, smalls: list[bytes]):
    """A server with an 8 MiB --max-inflight-bytes, 6 MiB of it held by a reader that does not
    take its answer; yields (client, id of another 6 MiB value, ids of `smalls`)."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--max-batch-size", "64MiB",
                    "--max-inflight-bytes", "8MiB", "--request-timeout", "30").start()
    big = [bytes([i]) * (6 << 20) for i in range(2)]
    big_ids = [hashlib.sha256(v).digest() for v in big]
    small_ids = [hashlib.sha256(v).digest() for v in smalls]
    slow: list[socket.socket] = []
    try:
        with ServerClient(s.address, local_read=False, timeout=20) as c:
            assert c.put(list(zip(big_ids, big))) == (2, 0, 0)
            for i in range(0, len(smalls), 64):
                assert c.put(list(zip(small_ids[i:i + 64], smalls[i:i + 64])))[2] == 0
            host, port = c.info().data_address.rsplit(":", 1)
            # Sent again while refused busy itself: a request answered just before may still hold its
            # bytes until its thread releases them after the answer (as procs.stalled_put).
            for _ in range(10):
                k = socket.socket()
                slow.append(k)
                k.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
                k.connect((host, int(port)))
                k.sendall(wire.pack_header(ops.GET.code, 0, 1, 32) + big_ids[0])  # 6 MiB answer, not read
                with contextlib.suppress(AssertionError):
                    wait_until(lambda: _busy(lambda: c.get([big_ids[1]])), "a get refused while the answer is held", 3)
                    break
                k.close()
            else:
                raise AssertionError("no 6 MiB answer held in 10 tries")
            yield c, big_ids[1], small_ids
    finally:
        for k in slow:
            k.close()
        assert s.stop() == 0


def test_a_get_counts_its_values_as_it_reads_them(tmp_path):
    """Before: the get read all its 16 MiB (4 groups) before counting any of it, then found
    them past the budget and answered busy; many such gets at once held that many answers
    uncounted. Now its first group is counted as read, the values that fit are sent and the
    rest answered as misses (get_cut_for_size), the later groups not read."""
    smalls = [os.urandom(SMALL) for _ in range(4 * GROUP)]
    with _six_of_eight_mib_held(tmp_path, smalls) as (c, _, ids):
        before = c.stats().counters
        got = c.get(ids)  # ~2 MiB of room: about 31 values of 64 KiB
        hits = sum(g is not None for g in got)
        assert 8 <= hits < 32, hits
        assert [bytes(g) for g in got[:hits]] == smalls[:hits] and got[hits:] == [None] * (len(ids) - hits)
        after = c.stats().counters
        assert after["get_cut_for_size"] - before["get_cut_for_size"] == len(ids) - hits
        assert (after["gets"] - before["gets"], after["get_hits"] - before["get_hits"]) == (len(ids), hits)


def test_a_get_answered_busy_is_not_counted(tmp_path):
    """Before: a get was counted (gets, get_hits, get_bytes) when its values were read, then
    answered busy: the counters told of hits no client got."""
    with _six_of_eight_mib_held(tmp_path, []) as (c, big_id, _):
        before = c.stats().counters
        for _ in range(3):
            assert "--max-inflight-bytes" in _busy(lambda: c.get([big_id]))
        after = c.stats().counters
        assert after["busy_refused"] - before["busy_refused"] == 3
        for name in ("gets", "get_hits", "get_misses", "get_bytes"):
            assert after[name] == before[name], name


@pytest.mark.parametrize("in_flight", [0, 900])
def test_bounded_get_takes_its_budget_once_per_group(in_flight):
    """One take per group read (no lock per value); what is not granted is a miss, and a
    lone get (nothing else in flight) is granted all of it whatever the limit."""
    vals = {bytes([i]) * 32: memoryview(bytes(100)) for i in range(GROUP * 3)}
    admission = Admission(max_bytes=1000, max_conns=1)
    admission.admit(in_flight)
    budget = AnswerBudget(admission, held=0)
    takes = []

    def take(n):
        takes.append(n)
        return budget.take(n)
    out, cut = bounded_get(lambda ks: [vals.get(k) for k in ks], list(vals), 1 << 30, take)
    if in_flight:  # 100 bytes of room: the first value only
        assert takes == [GROUP * 100] and sum(v is not None for v in out) == 1 and cut == len(vals) - 1
        assert budget.taken == 100 and budget.why and "--max-inflight-bytes" in budget.why
    else:
        assert takes == [GROUP * 100] * 3 and cut == 0 and None not in out and budget.taken == GROUP * 300
    budget.release()
    assert admission.in_flight == in_flight


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls") / "certs")


def test_a_dribbled_tls_handshake_is_cut_off_in_total(tmp_path, certs):
    """A guard (no fix: CPython's do_handshake takes its socket timeout as one deadline for the
    whole handshake): a ClientHello sent a byte per 2 s, never a 10 s stall, still frees its
    connection slot after HANDSHAKE_SECONDS in total, not after every byte has come."""
    dport = free_port()
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--data-listen", f"127.0.0.1:{dport}", "--unix-socket", "off",
                    "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                    "--tls-ca", str(certs / "ca.pem")).start()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    with contextlib.suppress(ssl.SSLWantReadError):
        ctx.wrap_bio(ssl.MemoryBIO(), out).do_handshake()
    hello = out.read()
    k = socket.create_connection(("127.0.0.1", dport), timeout=2)
    try:
        started, closed = time.monotonic(), None
        for b in hello[:-1]:  # never all of it: the server cannot go on before it is whole
            try:
                k.sendall(bytes([b]))
                if k.recv(1) == b"":  # waits 2 s for the server to close it
                    closed = time.monotonic() - started
                    break
            except TimeoutError:
                pass
            except OSError:
                closed = time.monotonic() - started
                break
            if time.monotonic() - started > HANDSHAKE_SECONDS + 6:
                break
        assert closed is not None and closed < HANDSHAKE_SECONDS + 4, closed
    finally:
        k.close()
        assert s.stop() == 0
