"""`cacheserver` start-up against real processes: a port it cannot use is a one-line
error with exit 2 before anything is served (not a traceback, not a wrong port), an
IPv6 --listen is announced as clients dial it, and the paths Info announces are
absolute. A constructor that fails releases the data dir for the next try; cachemanager
refuses a metrics port in use the same way."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.runtime import split_hostport
from cacheserver.server import CacheServer, ServerConfig
from cacheserver.serverd import build_parser
from procs import ROOT, Daemon, free_port


def _refused(tmp_path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run the daemon with `flags` (after a default --listen/--data-dir/--capacity);
    a daemon that starts anyway is stopped, and the test fails."""
    argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir",
            str(tmp_path / "d"), "--capacity", "64MB", "--log-format", "text", *flags]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
        if first.startswith("READY"):
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=30)
            pytest.fail(f"cacheserver started with {flags}: {first.strip()}")
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return subprocess.CompletedProcess(argv, p.returncode, first, err)


def _held_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_grpc_port_in_use_is_a_one_line_error(tmp_path):
    with _held_port() as s:
        port = s.getsockname()[1]
        r = _refused(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cacheserver: error: --listen: cannot bind 127.0.0.1:{port}" in r.stderr


def test_metrics_port_in_use_is_refused_before_serving(tmp_path):
    with _held_port() as s:
        port = s.getsockname()[1]
        r = _refused(tmp_path, "--metrics-port", str(port))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cacheserver: error: --metrics-port: cannot serve metrics on 127.0.0.1:{port}" in r.stderr
    assert not (tmp_path / "d" / "data.sock").exists()  # nothing served, nothing left behind


@pytest.mark.parametrize("flag,value", [("--listen", "127.0.0.1:70000"), ("--data-listen", "127.0.0.1:65536")])
def test_a_port_past_65535_is_refused_not_wrapped(tmp_path, flag, value):
    """gRPC bound 127.0.0.1:70000 as port 4464 (70000 mod 65536) and served there."""
    r = _refused(tmp_path, flag, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{flag}: port out of range in '{value}'" in r.stderr


def test_split_hostport_checks_the_port_range():
    assert split_hostport("[::1]:65535", "x") == ("::1", 65535)
    with pytest.raises(ValueError, match="out of range"):
        split_hostport("host:70000", "x")


@pytest.mark.parametrize("argv,says", [
    (["--metrics-port", "70000"], "argument --metrics-port: expected a port 0-65535, got '70000'"),
    (["--capacity", "10XB"], "argument --capacity: not a size: '10XB' (expected e.g. 200GB"),
    # 0 started a server that answered every data-plane connection 'server busy': all misses
    (["--max-connections", "0"], "argument --max-connections: must be positive, got 0"),
    (["--max-connections", "-1"], "argument --max-connections: must be positive, got -1"),
])
def test_bad_flag_values_are_named(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--listen", "h:1", "--data-dir", "/d", "--capacity", "1GB", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_listen_is_announced_in_brackets(tmp_path):
    """READY, Info and the manager registration used "::1:PORT", which no client can dial."""
    os.makedirs(tmp_path / "d")
    d = Daemon(["cacheserver.serverd", "--listen", "[::1]:0", "--data-dir", str(tmp_path / "d"),
                "--capacity", "64MB", "--log-format", "text"], log_path=str(tmp_path / "d.log")).start()
    try:
        assert d.address.startswith("[::1]:"), d.address
        with ServerClient(d.address, prefer_unix=False) as c:
            assert c.put([(b"\1" * 32, b"v6")]) == (1, 0, 0)
            assert bytes(c.get([b"\1" * 32])[0]) == b"v6"
            assert c.transport == "tcp" and c.info().data_address.startswith("[::1]:")
    finally:
        assert d.stop() == 0


def test_info_announces_an_absolute_unix_socket_for_a_relative_data_dir(tmp_path, monkeypatch):
    """Same-host clients look the socket up from their own working directory."""
    monkeypatch.chdir(tmp_path)
    s = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir="rel", capacity=64 << 20))
    try:
        assert s._info().unix_socket == str(tmp_path / "rel" / "data.sock")
    finally:
        s.stop(grace=0)


def test_a_unix_socket_that_cannot_be_bound_is_named_and_the_data_dir_released(tmp_path):
    """With a fixed gRPC port the failure fell into the data-plane port fallback and came
    out as a bare "[Errno 2] No such file or directory"; the half-made server kept the
    data dir locked, so a retry in the same process was refused as "in use"."""
    sock = tmp_path / "missing" / "data.sock"
    port = free_port()
    cfg = ServerConfig(listen=f"127.0.0.1:{port}", data_dir=str(tmp_path / "d"), capacity=64 << 20,
                       unix_socket=str(sock))
    with pytest.raises(OSError, match=f"unix socket {sock}: cannot bind"):
        CacheServer(cfg)
    # the data dir and the gRPC port are free again (grpcio frees a port only when a started server stops)
    again = CacheServer(ServerConfig(listen=f"127.0.0.1:{port}", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    again.stop(grace=0)


def test_a_stop_waits_one_grace_for_all_stalled_connections(tmp_path):
    """SIGTERM with connections stalled mid-request. Before: the data plane waited for each
    connection's thread in turn, each up to its grace (8 stalled: 8 s past --drain-seconds 2,
    the store closed by nobody once systemd's or Kubernetes' SIGKILL came first)."""
    import time

    data = free_port()
    d = Daemon(["cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
                "--capacity", "64MB", "--data-listen", f"127.0.0.1:{data}", "--unix-socket", "off",
                "--drain-seconds", "2"], str(tmp_path / "log")).start()
    conns = []
    try:
        for _ in range(8):
            c = socket.create_connection(("127.0.0.1", data), timeout=10)
            c.sendall(b"\x00\x01\x02")  # part of a frame header: the server's thread waits for the rest
            conns.append(c)
        time.sleep(0.5)  # every connection accepted and in its read
        t0 = time.monotonic()
        assert d.stop(timeout=30) == 0
        took = time.monotonic() - t0
    finally:
        for c in conns:
            c.close()
        d.kill()
    assert took < 5.0, f"the stop took {took:.1f} s"


def test_cachemanager_metrics_port_in_use_is_refused_before_serving(tmp_path):
    """Before: a traceback (exit 1) once gRPC was serving."""
    held = _held_port()
    try:
        argv = [sys.executable, "-m", "manager.managerd", "--listen", "127.0.0.1:0", "--state-dir",
                str(tmp_path / "s"), "--log-format", "text", "--metrics-port", str(held.getsockname()[1])]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    assert r.returncode == 2 and not r.stdout.startswith("READY"), r.stdout + r.stderr
    assert "--metrics-port: cannot serve metrics on 127.0.0.1:" in r.stderr and "Traceback" not in r.stderr


def test_a_unix_socket_path_in_use_is_refused_and_a_stale_one_replaced(tmp_path):
    """Before: a server given another live server's --unix-socket deleted it and took the
    path over (the first's same-host clients then reached the second's store), and a
    regular file there was deleted too."""
    sock = str(tmp_path / "shared.sock")

    def cfg(name):
        return ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / name), capacity=64 << 20,
                            unix_socket=sock)
    first = CacheServer(cfg("a"))
    first.start()
    try:
        with pytest.raises(OSError, match=f"unix socket {sock}: cannot bind: in use by a running server"):
            CacheServer(cfg("b"))
        c = socket.socket(socket.AF_UNIX)
        c.connect(sock)                      # still the first's
        c.close()
    finally:
        first.stop(grace=0)
    stale = socket.socket(socket.AF_UNIX)    # bound, never listening: what a killed server leaves
    stale.bind(sock)
    stale.close()
    second = CacheServer(cfg("b"))           # a stale socket is replaced
    second.stop(grace=0)
    with open(sock, "w") as f:
        f.write("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket"):
        CacheServer(cfg("b"))
    assert open(sock).read() == "not a socket"


def test_listen_on_the_last_port_gives_the_data_plane_a_free_port(tmp_path):
    """--data-listen auto is the gRPC port + 1: on 65535 that was 65536 and an OverflowError
    traceback."""
    try:
        s = CacheServer(ServerConfig(listen="127.0.0.1:65535", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    except OSError as e:  # the port is taken on this host: nothing to show here
        pytest.skip(str(e))
    try:
        assert s.port == 65535 and 0 < s.dataplane.tcp_address[1] < 65535
    finally:
        s.stop(grace=0)


def test_a_stopped_server_frees_its_metrics_port(tmp_path):
    port = free_port()
    cfg = ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=64 << 20, metrics_port=port)
    s = CacheServer(cfg)
    s.start()
    s.stop(grace=0)
    again = CacheServer(cfg)  # same process, s still referenced: its metrics socket must be closed
    again.stop(grace=0)
    assert s.metrics_server[0].socket.fileno() == -1


def test_metrics_port_zero_is_logged_and_empty_is_off(tmp_path):
    """--metrics-port 0 binds a free port that the start-up line names (else nobody could
    scrape it); an empty value (systemd's METRICS_PORT=) starts the server without metrics."""
    import json
    import urllib.request

    from procs import cacheserver
    s = cacheserver(str(tmp_path / "a"), "64MB", 0, "--metrics-port", "0", "--log-format", "json").start()
    try:
        with open(os.path.join(str(tmp_path / "a"), "server.log")) as f:
            started = [json.loads(line) for line in f if '"cacheserver started"' in line]
        addr = started[0]["metrics"]
        assert addr and not addr.endswith(":0"), started
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            assert b"mlcache" in r.read()
    finally:
        s.kill()
    off = cacheserver(str(tmp_path / "b"), "64MB", 0, "--metrics-port", "").start()
    try:
        with ServerClient(off.address, local_read=False) as c:
            assert c.stats().capacity_bytes > 0
    finally:
        off.kill()
