"""--request-timeout bounds stalls, not slow progress: a large answer to a slow
reader is sent whole (plain TCP and TLS), one to a reader that stops is cut off;
real daemons."""
import hashlib
import os
import socket
import time

import pytest

from cacheserver import ops, wire
from cacheserver.client.server_client import ServerClient
from cacheserver.tls import TlsFiles
from procs import cacheserver, free_port, make_certs

VALUE_MIB = 24
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls") / "certs")


def _server(tmp_path, tls: TlsFiles | None):
    dport = free_port()
    extra = ["--unix-socket", "off", "--request-timeout", str(TIMEOUT_S), "--max-batch-size", "64MiB",
             "--data-listen", f"127.0.0.1:{dport}"]
    if tls:
        extra += ["--tls-cert", tls.cert.replace("client", "server"), "--tls-key",
                  tls.key.replace("client", "server"), "--tls-ca", tls.ca]
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, *extra).start()
    return s, dport


def _raw_get(port: int, tls: TlsFiles | None, key: bytes) -> socket.socket:
    k = socket.socket()
    k.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the reader's pace sets the server's
    k.settimeout(10)
    k.connect(("127.0.0.1", port))
    if tls:
        k = tls.client_context().wrap_socket(k)
    k.sendall(wire.pack_header(ops.GET.code, 0, 1, len(key)) + key)
    return k


def _read_slowly(k: socket.socket, n: int, seconds: float) -> bytes:
    """Read n bytes at about n/seconds bytes per second (bounded: 4 x seconds)."""
    got, step, deadline = bytearray(), 256 << 10, time.monotonic() + 4 * seconds
    pause = seconds * step / n
    while len(got) < n and time.monotonic() < deadline:
        b = k.recv(min(step, n - len(got)))
        if not b:
            break
        got += b
        time.sleep(pause * len(b) / step)
    return bytes(got)


@pytest.mark.parametrize("secure", [False, True], ids=["tcp", "tls"])
def test_slow_reader_gets_whole_answer_and_stopped_reader_is_cut_off(tmp_path, certs, secure):
    tls = TlsFiles(str(certs / "client.pem"), str(certs / "client-key.pem"), str(certs / "ca.pem")) if secure else None
    s, dport = _server(tmp_path, tls)
    try:
        value = os.urandom(VALUE_MIB << 20)
        key = hashlib.sha256(value).digest()
        with ServerClient(s.address, tls=tls, local_read=False) as c:
            assert c.put([(key, value)])[0] == 1
        with _raw_get(dport, tls, key) as k:  # about 4 s at ~6 MiB/s: 4 timeouts, always progressing
            answer = _read_slowly(k, wire.HEADER.size + 4 + len(value), 4 * TIMEOUT_S)
        assert len(answer) == wire.HEADER.size + 4 + len(value)
        assert answer[wire.HEADER.size + 4:] == value
        with _raw_get(dport, tls, key) as k:  # reads nothing: cut off after a timeout
            deadline, stalls = time.monotonic() + 15, 0
            with ServerClient(s.address, tls=tls, local_read=False, use_dataplane=False) as c:
                while stalls == 0 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    stalls = c.stats().counters["reply_stalls"]
            assert stalls == 1
        log = open(tmp_path / "d" / "server.log").read()
        assert "whose reader took nothing for 1 s" in log and "Traceback" not in log
    finally:
        assert s.stop() == 0
