"""Flags that cannot be right are named at start: a server missing from its own
--peers (and the client that learns such a ring), a --capacity the disk cannot
hold; and the command lines document what they take."""
import logging
import subprocess
import sys
from pathlib import Path

from cacheserver.client.ring_client import RingClient
from procs import cacheserver, free_port

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_capacity_beyond_free_space_refused(tmp_path):
    r = _run("cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
             "--capacity", "900TiB")
    assert r.returncode == 2
    assert "--capacity 900.0 TiB is more than" in r.stderr and "free; pass --capacity" in r.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_server_missing_from_its_peers_says_so(tmp_path, caplog):
    s = cacheserver(str(tmp_path / "a"), "64MB", 0, "--peers", "vm1.invalid:7070,vm2.invalid:7070").start()
    try:
        log = Path(s.log_path).read_text()
        assert "does not include this server (listening on 127.0.0.1:" in log
        assert "these do not resolve here: vm1.invalid:7070, vm2.invalid:7070" in log
        with caplog.at_level(logging.WARNING, "cacheserver.ring"):
            assert RingClient.resolve(s.address) == ["vm1.invalid:7070", "vm2.invalid:7070"]
        said = [r.getMessage() for r in caplog.records if "is not in the ring it serves" in r.getMessage()]
        assert len(said) == 1 and s.address in said[0]
    finally:
        s.kill()


def test_server_in_its_peers_is_quiet(tmp_path, caplog):
    port = free_port()
    s = cacheserver(str(tmp_path / "a"), "64MB", port, "--peers", f"localhost:{port}").start()
    try:
        assert "does not include this server" not in Path(s.log_path).read_text()
        with caplog.at_level(logging.WARNING, "cacheserver.ring"):
            assert RingClient.resolve(s.address) == [f"localhost:{port}"]  # the same server by name
        assert not [r for r in caplog.records if "not in the ring" in r.getMessage()]
    finally:
        s.kill()


def test_help_documents_commands_and_log_flags():
    ctl = _run("manager.ctl", "--help").stdout
    assert "cachectl status --manager ADDR" in ctl
    srv = _run("cacheserver.serverd", "--help").stdout
    assert "least severe log lines" in srv and "one JSON object per line" in srv
