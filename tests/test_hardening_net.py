"""Issue 12 items 1-3: what one request or many connections can make a server
hold, and how its accept loop meets a lack of file descriptors; real daemons."""
import hashlib
import os
import resource
import socket
import time

import pytest

from cacheserver import ops, wire
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, rss_bytes


@pytest.mark.parametrize("plane", ["dataplane", "grpc"])
def test_get_naming_one_large_id_many_times_is_bounded(tmp_path, plane):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--max-batch-size", "8MiB", "--unix-socket", "off").start()
    try:
        value = os.urandom(1 << 20)
        key = hashlib.sha256(value).digest()
        opts = {"use_dataplane": plane == "dataplane", "local_read": False}
        with ServerClient(s.address, **opts) as c:
            assert c.put([(key, value)])[0] == 1
            base = rss_bytes(s.pid)
            got = c.get([key] * 400)  # 400 MiB if answered in full
            peak = rss_bytes(s.pid)
            st = c.stats()
        held = [g for g in got if g is not None]
        assert 1 <= len(held) <= 8 and all(bytes(g) == value for g in held)
        assert all(g is None for g in got[len(held):])
        assert st.counters["get_cut_for_size"] == 400 - len(held)
        assert peak - base < 100 << 20, (base, peak)
    finally:
        assert s.stop() == 0


def _data_addr(address: str) -> tuple[str, int]:
    with ServerClient(address, use_dataplane=False) as c:
        host, port = c.info().data_address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _ping_get(address: str, key: bytes, value: bytes) -> None:
    with ServerClient(address, local_read=False) as c:  # a fresh data-plane connection
        assert [bytes(v) for v in c.get([key])] == [value]


def _server_with_one_item(tmp_path) -> tuple:
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--unix-socket", "off").start()
    value = b"v" * 1000
    key = hashlib.sha256(value).digest()
    with ServerClient(s.address, local_read=False) as c:
        c.put([(key, value)])
    return s, key, value


def test_accept_loop_survives_running_out_of_descriptors(tmp_path):
    s, key, value = _server_with_one_item(tmp_path)
    try:
        addr = _data_addr(s.address)
        in_use = len(os.listdir(f"/proc/{s.pid}/fd"))
        hard = resource.prlimit(s.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(s.pid, resource.RLIMIT_NOFILE, (in_use + 4, hard))
        socks = [socket.create_connection(addr, timeout=5) for _ in range(16)]
        time.sleep(1.0)  # the server meets EMFILE on accept
        for k in socks:
            k.close()
        resource.prlimit(s.pid, resource.RLIMIT_NOFILE, (min(4096, hard), hard))
        time.sleep(1.5)
        _ping_get(s.address, key, value)  # still accepting
        log = open(tmp_path / "d" / "server.log").read()
        assert "accepting a data-plane connection failed: [Errno 24]" in log
    finally:
        assert s.stop() == 0


def test_connection_past_descriptor_1024_is_served(tmp_path):
    s, key, value = _server_with_one_item(tmp_path)
    socks = []
    try:
        addr = _data_addr(s.address)
        socks = [socket.create_connection(addr, timeout=5) for _ in range(1030)]
        deadline = time.monotonic() + 20
        while len(os.listdir(f"/proc/{s.pid}/fd")) < 1030 and time.monotonic() < deadline:
            time.sleep(0.1)
        _ping_get(s.address, key, value)
    finally:
        for k in socks:
            k.close()
        assert s.stop() == 0


def _remote_error(sock: socket.socket) -> tuple[int, str]:
    """The error frame the server sent on ``sock`` (status, message)."""
    sock.settimeout(10)
    status, aux_len, _, _ = wire.unpack_header(wire.recv_exact(sock, wire.HEADER.size))
    return status, wire.recv_exact(sock, aux_len).decode()


def test_request_bodies_in_flight_capped_and_stalled_senders_cut_off(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--max-batch-size", "64MiB",
                    "--max-inflight-bytes", "80MiB", "--request-timeout", "3").start()
    socks = []
    try:
        addr = _data_addr(s.address)
        base = rss_bytes(s.pid)
        chunk = b"\0" * (1 << 20)
        for _ in range(4):  # each sends most of a 60 MiB put body, then stalls
            k = socket.create_connection(addr, timeout=5)
            socks.append(k)
            k.sendall(wire.pack_header(ops.PUT.code, 0, 1, 60 << 20))
            try:
                for _ in range(50):
                    k.sendall(chunk)
            except (TimeoutError, OSError):
                pass  # refused: the server does not read its body
        peak = rss_bytes(s.pid)
        refused = []
        for k in socks[1:]:
            status, msg = _remote_error(k)
            refused.append(status == wire.UNAVAILABLE and msg.startswith("server busy: ")
                           and "--max-inflight-bytes" in msg)
        assert all(refused) and len(refused) == 3
        assert peak - base < 110 << 20, (base, peak)  # one body, not four
        socks[0].settimeout(10)
        assert socks[0].recv(100) == b""  # the stalled sender was cut off
        with ServerClient(s.address, local_read=False) as c:
            value = b"x" * 1000
            assert c.put([(hashlib.sha256(value).digest(), value)])[0] == 1
            st = c.stats()
        assert st.counters["request_timeouts"] == 1 and st.counters["busy_refused"] == 3
    finally:
        for k in socks:
            k.close()
        assert s.stop() == 0


def test_connections_past_the_cap_are_answered_busy(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--unix-socket", "off", "--max-connections", "4").start()
    socks = []
    try:
        addr = _data_addr(s.address)
        socks = [socket.create_connection(addr, timeout=5) for _ in range(4)]
        time.sleep(0.5)
        extra = socket.create_connection(addr, timeout=5)
        socks.append(extra)
        status, msg = _remote_error(extra)
        assert status == wire.UNAVAILABLE and "4 data-plane connections open, limit 4" in msg
        for k in socks[:4]:
            k.close()
        time.sleep(0.5)
        value = b"y" * 100
        with ServerClient(s.address, local_read=False) as c:  # room again
            assert c.put([(hashlib.sha256(value).digest(), value)])[0] == 1
    finally:
        for k in socks:
            k.close()
        assert s.stop() == 0
