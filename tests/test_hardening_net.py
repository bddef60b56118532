"""Issue 12 items 1-3: what one request or many connections can make a server
hold, and how its accept loop meets a lack of file descriptors; real daemons."""
import hashlib
import os
import resource
import socket
import time

import pytest

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
