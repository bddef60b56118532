"""The daemon's seconds flags in range, and what a client sees of a server that refuses or
drops it (busy, a stalled header, a TLS peer that resets at once); real daemons on loopback."""
import hashlib
import socket
import struct
import subprocess
import sys

import pytest

from cacheserver import ops, wire
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from cacheserver.tls import TlsFiles
from cacheserver.vocab import FETCH
from procs import ROOT, cacheserver, free_port, make_certs, stalled_put, wait_until


def _daemon_fails(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """Run the daemon with `flags`; one that starts is stopped at once (its exit code 0)."""
    argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir",
            str(tmp_path / "d"), "--capacity", "64MB", "--unix-socket", "off", "--log-format", "text", *flags]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
        if first.startswith("READY"):
            p.terminate()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return subprocess.CompletedProcess(argv, p.returncode, first + out, err)


@pytest.mark.parametrize("flag,value,says", [
    # before: a gRPC OverflowError traceback at start-up (10 x the timeout in ms is a C int)
    ("--request-timeout", "400000", "argument --request-timeout: must be at most 86400 seconds"),
    ("--request-timeout", "inf", "argument --request-timeout: must be at most 86400 seconds"),
    ("--request-timeout", "nan", "argument --request-timeout: must be positive, got nan"),
    # before: accepted; a claimant that died had its items waited on forever
    ("--claim-ttl", "inf", "argument --claim-ttl: must be at most 86400 seconds"),
    # before: accepted, and SIGTERM dropped the calls in flight
    ("--drain-seconds", "-1", "argument --drain-seconds: must be >= 0, got -1"),
    ("--drain-seconds", "nan", "argument --drain-seconds: must be >= 0, got nan"),
])
def test_out_of_range_seconds_are_refused_naming_the_flag(tmp_path, flag, value, says):
    p = _daemon_fails(tmp_path, flag, value)
    assert not p.stdout.startswith("READY"), (flag, value)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_largest_request_timeout_and_zero_drain_start(tmp_path):
    p = _daemon_fails(tmp_path, "--request-timeout", "86400", "--drain-seconds", "0")
    assert p.stdout.startswith("READY") and p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_large_put_refused_busy_is_answered_busy_and_its_claims_released(tmp_path, transport):
    """Before: the server closed the connection with the put's body unread, which reset it
    under the client still sending; the ring took the busy server for a dead one and did
    not ask it to release the claims, so another job waited out the whole --claim-ttl."""
    extra = ["--unix-socket", "off"] if transport == "tcp" else []
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--max-batch-size", "64MiB", "--max-inflight-bytes",
                    "8MiB", "--claim-ttl", "300", *extra).start()
    try:
        with ServerClient(s.address, local_read=False) as c:
            info = c.info()
        values = [bytes([i]) * (4 << 20) for i in range(5)]
        items = [(hashlib.sha256(v).digest(), v) for v in values]
        ids = [k for k, _ in items]
        with RingClient([s.address], local_read=False, timeout=20) as a, \
                ServerClient(s.address, local_read=False, timeout=20) as b:
            assert a.claim(ids, "a") == [FETCH] * 5
            stall = stalled_put(lambda: _connect(info, transport), lambda: _admitted(b, ids) is None)
            with pytest.raises(wire.RemoteError, match="server busy: .*--max-inflight-bytes"):
                b.put(items, "b")  # the client is told why, its connection not reset
            unsent: list[int] = []
            assert a.put(items, "a", unsent=unsent) == 0 and unsent == list(range(5))
            stall.close()  # the budget is free again
            wait_until(lambda: _admitted(b, ids), "a look-up admitted")
            assert a.release(ids, "a") == [True] * 5  # the busy server, down for a's ring, was asked
            assert b.claim(ids, "b") == bytes([FETCH]) * 5  # not WAIT for 300 s
            assert b.stats().counters["busy_refused"] >= 2
    finally:
        assert s.stop() == 0


def _connect(info, transport: str) -> socket.socket:
    if transport == "tcp":
        host, port = info.data_address.rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=5)
    k = socket.socket(socket.AF_UNIX)
    k.connect(info.unix_socket)
    return k


def _admitted(c: ServerClient, ids: list[bytes]) -> bytes | None:
    try:
        return c.lookup(ids)
    except wire.RemoteError:  # still busy
        return None


def test_a_header_that_stalls_is_cut_off_and_counted(tmp_path):
    """Before: cut off, but neither counted in request_timeouts nor logged (only a body's stall was)."""
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--unix-socket", "off", "--request-timeout", "1").start()
    try:
        with ServerClient(s.address, local_read=False) as c:
            host, port = c.info().data_address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as k:
                k.sendall(wire.pack_header(ops.LOOKUP.code, 0, 1, 32)[:10])  # half a header, then nothing
                assert k.recv(100) == b""  # cut off
            assert wait_until(lambda: c.stats().counters["request_timeouts"] == 1, "the stall counted")
        assert "whose request stalled for 1 s" in open(tmp_path / "d" / "server.log").read()
    finally:
        assert s.stop() == 0


def test_tls_data_plane_accepts_on_after_peers_that_reset_at_once(tmp_path):
    """Before: a peer that sent bytes and reset before the server wrapped its socket made
    wrap_socket raise in the accept thread, which died: the listener stayed open unanswered,
    so every later client hung until its timeout (and the connection slot was never freed)."""
    certs = make_certs(tmp_path / "certs")
    dport = free_port()
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--data-listen", f"127.0.0.1:{dport}", "--unix-socket", "off",
                    "--max-connections", "8", "--tls-cert", str(certs / "server.pem"),
                    "--tls-key", str(certs / "server-key.pem"), "--tls-ca", str(certs / "ca.pem")).start()
    try:
        for _ in range(200):  # some of them reset before they are accepted
            try:
                k = socket.create_connection(("127.0.0.1", dport), timeout=2)
            except TimeoutError:
                break  # the backlog is full: nobody accepts any more
            k.sendall(b"\x16" * 50)
            k.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            k.close()
        tls = TlsFiles(str(certs / "client.pem"), str(certs / "client-key.pem"), str(certs / "ca.pem"))
        with ServerClient(s.address, tls=tls, local_read=False, prefer_unix=False, timeout=10) as c:
            assert c.lookup([bytes(32)] * 3) == bytes(3) and c.transport == "tcp"
        assert "Traceback" not in open(tmp_path / "d" / "server.log").read()
    finally:
        assert s.stop() == 0
