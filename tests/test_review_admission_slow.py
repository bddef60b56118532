"""--request-timeout bounds a stall; a whole request body or answer must also move at
dataplane.MIN_RATE on average, so a peer that dribbles cannot keep its share of
--max-inflight-bytes for as long as it likes; real daemons on loopback."""
import hashlib
import os
import socket
import threading
import time

from cacheserver import ops, wire
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, wait_until

MIN_RATE = 1 << 20  # the slowest average a body or an answer may move at (docs/operations.md)


def _dribble(k: socket.socket, stop: threading.Event, every: float) -> None:
    """One byte per `every` seconds (under --request-timeout: never a stall) until stopped or cut off."""
    deadline = time.monotonic() + 30
    while not stop.wait(every) and time.monotonic() < deadline:
        try:
            k.sendall(b"\0")
        except OSError:
            return


def _put_admitted(c: ServerClient, item: tuple[bytes, bytes]) -> bool:
    try:
        return sum(c.put([item])[:2]) == 1  # stored, or already there
    except wire.RemoteError as e:  # busy
        assert "--max-inflight-bytes" in str(e), e
        return False


def test_a_dribbled_put_body_is_cut_off_and_its_budget_freed(tmp_path):
    """Before: a body sent a byte per just under --request-timeout was never cut off, and
    held its declared size of --max-inflight-bytes: every other put was answered busy."""
    body = 2 << 20  # must be whole within 1 s + body / MIN_RATE (3 s)
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--request-timeout", "1",
                    "--max-batch-size", "64MiB", "--max-inflight-bytes", "2MiB").start()
    stop = threading.Event()
    try:
        value = os.urandom(1000)
        item = (hashlib.sha256(value).digest(), value)
        with ServerClient(s.address, local_read=False, timeout=20) as c:
            host, port = c.info().data_address.rsplit(":", 1)
            k = socket.create_connection((host, int(port)), timeout=20)
            k.sendall(wire.pack_header(ops.PUT.code, 0, 1, body) + bytes(100))
            t = threading.Thread(target=_dribble, args=(k, stop, 0.3), daemon=True)
            t.start()
            started = time.monotonic()
            wait_until(lambda: not _put_admitted(c, item), "the dribbler holding the whole budget")
            wait_until(lambda: _put_admitted(c, item), "the dribbler cut off, the budget freed", timeout=12)
            assert time.monotonic() - started < 1 + body / MIN_RATE + 5
            assert c.stats().counters["request_timeouts"] == 1
            k.settimeout(5)
            try:
                assert k.recv(100) == b""  # closed by the server
            except ConnectionResetError:
                pass
            # a fast client is unaffected: 48 MiB with --request-timeout 1
            big = os.urandom(48 << 20)
            assert c.put([(hashlib.sha256(big).digest(), big)])[0] == 1
            assert bytes(c.get([hashlib.sha256(big).digest()])[0]) == big
        stop.set()
        t.join(10)
        k.close()
        assert "arrived slower than 1024 KiB/s" in open(tmp_path / "d" / "server.log").read()
    finally:
        stop.set()
        assert s.stop() == 0


def test_an_answer_read_too_slowly_is_cut_off(tmp_path):
    """Before: an answer read a little at a time, never a whole --request-timeout without
    taking a byte, was sent however long it took, holding its values (and, now that answers
    count, its share of --max-inflight-bytes) all along."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--request-timeout", "1").start()
    try:
        value = os.urandom(4 << 20)  # must be read within 1 s + 4 s
        key = hashlib.sha256(value).digest()
        with ServerClient(s.address, local_read=False, prefer_unix=False) as c:
            assert c.put([(key, value)])[0] == 1
            path = c.info().unix_socket
        total = wire.HEADER.size + 4 + len(value)
        with socket.socket(socket.AF_UNIX) as k:  # the server may write only a little ahead of the reader
            k.settimeout(15)
            k.connect(path)
            k.sendall(wire.pack_header(ops.GET.code, 0, 1, len(key)) + key)
            got, started = 0, time.monotonic()
            while got < total and time.monotonic() - started < 20:  # ~420 KiB/s: 10 s for the whole
                time.sleep(0.15)
                b = k.recv(64 << 10)
                if not b:
                    break
                got += len(b)
        assert got < total and time.monotonic() - started < 1 + 4 + 5
        with ServerClient(s.address, local_read=False) as c:
            assert c.stats().counters["reply_stalls"] == 1
        assert "or read slower than 1024 KiB/s" in open(tmp_path / "d" / "server.log").read()
    finally:
        assert s.stop() == 0
