"""`cachectl stats`, `cachectl ring` and `cachectl local-cluster` against real
server processes, run the way an operator runs them (`python -m manager.ctl`)."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.client.hashring import HashRing
from procs import ROOT, cacheserver, free_port, pid_alive


def cachectl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "manager.ctl", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def ident(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def refused_port() -> int:
    """A loopback port nobody listens on (bound, then closed without listen)."""
    return free_port()


# ---- stats ---------------------------------------------------------------------------
@pytest.fixture
def busy_server(server):
    """The conftest server with tagged data, a chunk reference and a bypassed job."""
    with ServerClient(server.address, local_read=False) as c:
        c.put([(ident(i), b"x" * 1000) for i in range(10)], dataset="imagenet", chunk=3)
        c.put([(ident(100 + i), b"y" * 500) for i in range(4)])
        c.get([ident(0), ident(1), ident(999)])
        c.ref_chunk("imagenet", 3, "job-a")
        c.active_chunk("imagenet", 3)
        c.set_job_mode("probe-job", 1)
    return server


def test_stats_table(busy_server):
    r = cachectl("stats", busy_server.address)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"server {busy_server.address}" in out
    assert re.search(r"capacity\s+953\.7 MiB\s+1,000,000,000 bytes", out), out
    assert re.search(r"^\s+items\s+14$", out, re.M), out
    assert re.search(r"^\s+put_stored\s+14$", out, re.M), out
    assert re.search(r"^\s+get_hits\s+2$", out, re.M), out
    assert "hit ratio 66.7% of 3 gets" in out
    row = [ln for ln in out.splitlines() if ln.strip().startswith("imagenet")]
    assert len(row) == 1 and row[0].split()[:3] == ["imagenet", "3", "10"], out
    assert "job-a" in row[0] and row[0].rstrip().endswith("yes")  # referenced and active
    assert re.search(r"^\s+probe-job\s+bypass$", out, re.M), out


def test_stats_json(busy_server):
    r = cachectl("stats", busy_server.address, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["address"] == busy_server.address
    assert d["capacity_bytes"] == 10**9 and d["items"] == 14
    assert d["used_bytes"] == 10 * (1000 + 128) + 4 * (500 + 128)  # store.OVERHEAD per entry
    assert d["free_bytes"] == d["capacity_bytes"] - d["used_bytes"]
    assert d["counters"]["put_stored"] == 14 and d["counters"]["get_misses"] == 1
    assert d["chunks"] == [{"dataset": "imagenet", "chunk": 3, "items": 10, "bytes": 10 * 1128,
                            "refs": 1, "jobs": ["job-a"]}]
    assert d["active_chunks"] == {"imagenet": 3}
    assert d["job_modes"] == {"probe-job": "bypass"}


@pytest.mark.parametrize("cmd", [["stats"], ["ring"], ["ring", "--check"]])
def test_unreachable_server_is_one_line(cmd):
    addr = f"127.0.0.1:{refused_port()}"
    r = cachectl(*cmd, addr, "--timeout", "3")
    assert r.returncode == 1
    assert r.stderr.startswith(f"cachectl: cannot reach {addr}: "), r.stderr
    assert "require TLS" not in r.stderr  # nothing listens there: not a TLS question
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_bad_address_is_a_usage_error():
    r = cachectl("stats", "no-port-here")
    assert r.returncode == 2 and "expected HOST:PORT" in r.stderr


# ---- ring ------------------------------------------------------------------------------
@pytest.fixture
def ring_of_two(tmp_path):
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    servers = []
    try:
        for i, p in enumerate(ports):
            servers.append(cacheserver(str(tmp_path / f"s{i}"), "1GB", p, "--peers", peers).start())
        yield [s.address for s in servers]
    finally:
        for s in servers:
            s.kill()


def test_ring_from_server_info(ring_of_two):
    a, b = ring_of_two
    r = cachectl("ring", a)
    assert r.returncode == 0, r.stderr
    assert f"ring: 2 members from the ring of {a} (its --peers, or its manager's ring), 160 vnodes each" in r.stdout
    share = HashRing([a, b]).describe()
    for m in (a, b):
        assert re.search(rf"^\s+{re.escape(m)}\s+{100 * share[m]:.1f}%\s+#+$", r.stdout, re.M), r.stdout

    r = cachectl("ring", b, "--json", "--vnodes", "32")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["members"] == sorted([a, b]) and d["vnodes"] == 32
    assert d["share"] == pytest.approx(HashRing([a, b], vnodes=32).describe())
    assert sum(d["share"].values()) == pytest.approx(1.0)


def test_ring_check(ring_of_two):
    a, b = ring_of_two
    r = cachectl("ring", a, "--check")
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r"#+\s+ok$", r.stdout, re.M)) == 2, r.stdout

    # A member list that differs from the servers' own --peers is reported, exit 1.
    extra = f"127.0.0.1:{refused_port()}"
    r = cachectl("ring", "--peers", f"{a},{b},{extra}", "--check", "--timeout", "3")
    assert r.returncode == 1
    assert f"peers differ: {','.join(sorted([a, b]))}" in r.stdout
    assert f"cannot reach {extra}" in r.stdout


def test_ring_from_arguments_and_peers_flag():
    r = cachectl("ring", "10.0.0.1:7400", "10.0.0.2:7400", "10.0.0.3:7400")
    assert r.returncode == 0, r.stderr
    assert "ring: 3 members from arguments" in r.stdout
    r2 = cachectl("ring", "--peers", "10.0.0.3:7400, 10.0.0.1:7400,10.0.0.2:7400")
    assert r2.returncode == 0, r2.stderr
    assert r.stdout.splitlines()[1:] == r2.stdout.splitlines()[1:]  # same ring, any order
    assert "ideal share 33.3%" in r.stdout
    r = cachectl("ring")
    assert r.returncode == 2 and "ADDR" in r.stderr
    r = cachectl("ring", "10.0.0.1:7400", "--peers", "10.0.0.2:7400")
    assert r.returncode == 2 and "not both" in r.stderr


def test_ring_of_a_standalone_server(server):
    r = cachectl("ring", server.address)
    assert r.returncode == 0, r.stderr
    assert "ring: 1 member" in r.stdout and "100.0%" in r.stdout
    assert "started without --peers" in r.stdout


# ---- local-cluster -----------------------------------------------------------------------
class Cluster:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "manager.ctl", "local-cluster", *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = ""

    def wait_ready(self, timeout: float = 60) -> list[str]:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"^ready: (\S+)$", self.out, re.M)
            if m and self.out.endswith("\n") and "use: cache=" in self.out:
                return m.group(1).split(",")
            if select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 65536).decode()
                if not chunk:
                    break
                self.out += chunk
        self.proc.kill()
        pytest.fail(f"local-cluster not ready (rc {self.proc.wait()}):\n{self.out}\n{self.proc.stderr.read().decode()}")

    @property
    def pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"pid (\d+)", self.out)]

    @property
    def data_dir(self) -> str:
        return re.search(r"data in (\S+)", self.out).group(1)

    def finish(self, timeout: float = 40) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.out += out.decode()
        return self.proc.returncode, self.out, err.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_local_cluster_serves_and_stops_on_sigterm():
    c = Cluster("--servers", "3", "--capacity", "1GB")
    try:
        addrs = c.wait_ready()
        assert len(addrs) == 3 and len(set(addrs)) == 3
        assert f"use: cache={','.join(addrs)}" in c.out
        assert len(c.pids) == 3 and all(pid_alive(p) for p in c.pids)
        data_dir = c.data_dir
        assert os.path.isdir(data_dir)
        for i, addr in enumerate(addrs):
            with ServerClient(addr, local_read=False) as cl:
                assert list(cl.info().peers) == addrs
                assert cl.put([(ident(i), f"value {i}".encode())]) == (1, 0, 0)
                assert bytes(cl.get([ident(i)])[0]) == f"value {i}".encode()
            with ServerClient(addr, local_read=False, prefer_unix=False) as cl:
                assert bytes(cl.get([ident(i)])[0]) == f"value {i}".encode()
                assert cl.transport == "tcp"
        r = cachectl("ring", addrs[0], "--check")
        assert r.returncode == 0 and r.stdout.count(" ok") == 3, r.stdout

        c.proc.send_signal(signal.SIGTERM)
        rc, out, err = c.finish()
        assert rc == 0, err
        assert "stopped 3 servers" in out
        assert not [p for p in c.pids if pid_alive(p)], "server processes left behind"
        assert not os.path.exists(data_dir), "temporary data dir left behind"
        for addr in addrs:
            host, port = addr.rsplit(":", 1)
            with pytest.raises(OSError):
                socket.create_connection((host, int(port)), timeout=1).close()
    finally:
        c.kill()


def test_local_cluster_sigint_with_data_dir_keeps_data(tmp_path):
    c = Cluster("--servers", "1", "--capacity", "64MiB", "--data-dir", str(tmp_path / "lc"))
    try:
        (addr,) = c.wait_ready()
        with ServerClient(addr, local_read=False) as cl:
            cl.put([(ident(1), b"kept")])
        c.proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        rc, _, err = c.finish()
        assert rc == 0, err
        assert os.path.isdir(tmp_path / "lc" / "server-0" / "db")
    finally:
        c.kill()
    # Restarted on the same data dir, the value is still there.
    c = Cluster("--servers", "1", "--capacity", "64MiB", "--data-dir", str(tmp_path / "lc"))
    try:
        (addr,) = c.wait_ready()
        with ServerClient(addr, local_read=False) as cl:
            assert bytes(cl.get([ident(1)])[0]) == b"kept"
        c.proc.send_signal(signal.SIGTERM)
        assert c.finish()[0] == 0
    finally:
        c.kill()


def test_local_cluster_reports_a_dead_server():
    c = Cluster("--servers", "2", "--capacity", "64MiB")
    try:
        c.wait_ready()
        victim, survivor = c.pids
        os.kill(victim, signal.SIGKILL)
        rc, _, err = c.finish()
        assert rc == 1
        assert re.search(r"cachectl: server \d \(127\.0\.0\.1:\d+\) died with exit code -9", err), err
        assert "stopping the other servers" in err
        assert not pid_alive(survivor)
        assert not os.path.exists(c.data_dir)
    finally:
        c.kill()


def test_local_cluster_busy_base_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cachectl("local-cluster", "--servers", "1", "--base-port", str(port))
    assert r.returncode == 1
    assert r.stderr.startswith("cachectl: local-cluster: port"), r.stderr
    assert f" {port}" in r.stderr and "already in use" in r.stderr and "Traceback" not in r.stderr
