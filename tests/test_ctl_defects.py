"""`cachectl` defects found in review, each against real processes: stats on a server
with a cluster token, local-cluster's setup failures and a Ctrl-C during its start,
and `certs --out` naming a file."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.roles import read_token
from procs import ROOT, cacheserver


def cachectl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "manager.ctl", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# ---- stats on a server with --cluster-token-file --------------------------------------
@pytest.fixture
def token_server(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("0123456789abcdef0123456789abcdef\n")
    tok.chmod(0o600)
    s = cacheserver(str(tmp_path / "srv"), "1GB", 0, "--cluster-token-file", str(tok)).start()
    try:
        with ServerClient(s.address, local_read=False, control_token=read_token(str(tok))) as c:
            c.put([(bytes([i]) * 32, b"x" * 100) for i in range(3)], dataset="imagenet", chunk=3)
            c.ref_chunk("imagenet", 3, "job-a")
            c.set_job_mode("probe-job", 1)
        yield s.address, str(tok)
    finally:
        s.kill()


def test_stats_takes_the_cluster_token(token_server):
    """The operator of a token-protected cluster sees chunks and job modes."""
    addr, tok = token_server
    r = cachectl("stats", addr, "--cluster-token-file", tok)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\s+probe-job\s+bypass$", r.stdout, re.M), r.stdout
    assert re.search(r"^\s+imagenet\s+3\s+3\s", r.stdout, re.M), r.stdout
    d = json.loads(cachectl("stats", addr, "--json", "--cluster-token-file", tok).stdout)
    assert d["job_modes"] == {"probe-job": "bypass"}


def test_stats_without_the_role_does_not_claim_all_jobs_normal(token_server):
    """Without the token the server hides tenants: the table must not say there are none."""
    addr, _ = token_server
    r = cachectl("stats", addr)
    assert r.returncode == 0, r.stderr
    assert "(all jobs normal)" not in r.stdout and "(no tagged chunks)" not in r.stdout, r.stdout
    assert "--cluster-token-file" in r.stdout


def test_stats_with_a_wrong_token_says_the_server_refused_it(tmp_path, token_server):
    """A token the server does not hold: names are hidden, and the table says why, not
    "(all jobs normal)" beside a job in bypass."""
    addr, _ = token_server
    wrong = tmp_path / "wrong"
    wrong.write_text("f" * 32 + "\n")
    wrong.chmod(0o600)
    r = cachectl("stats", addr, "--cluster-token-file", str(wrong))
    assert r.returncode == 0, r.stderr
    assert "(all jobs normal)" not in r.stdout and "(no tagged chunks)" not in r.stdout, r.stdout
    assert "did not accept --cluster-token-file" in r.stdout, r.stdout
    d = json.loads(cachectl("stats", addr, "--json", "--cluster-token-file", str(wrong)).stdout)
    assert d["tenants_hidden"] is True and d["job_modes"] == {}


def test_stats_of_an_open_server_with_no_tenants_says_none(tmp_path):
    """A server without a token or TLS hides nothing: empty tables say so plainly."""
    s = cacheserver(str(tmp_path / "open"), "64MB", 0).start()
    try:
        r = cachectl("stats", s.address)
    finally:
        s.kill()
    assert r.returncode == 0, r.stderr
    assert "(all jobs normal)" in r.stdout and "(no tagged chunks)" in r.stdout, r.stdout
    assert "hidden" not in r.stdout, r.stdout


def test_stats_bad_token_file_is_a_usage_error(tmp_path, token_server):
    addr, _ = token_server
    r = cachectl("stats", addr, "--cluster-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "--cluster-token-file" in r.stderr and "Traceback" not in r.stderr


# ---- local-cluster --------------------------------------------------------------------------
def test_local_cluster_data_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    r = cachectl("local-cluster", "--servers", "1", "--capacity", "64MiB", "--data-dir", str(f))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("cachectl: local-cluster: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_local_cluster_stops_servers_started_before_a_setup_failure(tmp_path):
    """server-1's data dir cannot be made: the error is one line, and server 0, already
    started, is stopped by cachectl itself before it exits."""
    base = tmp_path / "lc"
    base.mkdir()
    (base / "server-1").write_text("in the way")
    r = cachectl("local-cluster", "--servers", "2", "--capacity", "64MiB", "--data-dir", str(base))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and r.stderr.startswith("cachectl: local-cluster: "), r.stderr
    assert "server-1" in r.stderr
    assert not _processes_using(str(base / "server-0"))


def _processes_using(data_dir: str) -> list[int]:
    """Live processes whose command line names `data_dir`."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if data_dir.encode() in f.read():
                    out.append(int(d))
        except (OSError, ValueError):
            continue
    return out


def test_local_cluster_ctrl_c_during_start_exits_0(tmp_path):
    """Ctrl-C while the servers are still starting stops them and is no failure."""
    proc = subprocess.Popen([sys.executable, "-m", "manager.ctl", "local-cluster", "--servers", "2",
                             "--capacity", "64MiB", "--data-dir", str(tmp_path / "lc")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20  # both server processes exist, neither READY yet
        while time.monotonic() < deadline and len(list((tmp_path / "lc").glob("server-*/server.log"))) < 2:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert "ready:" not in out, "the servers were ready before the signal: nothing tested"
        assert proc.returncode == 0, err
        assert "exited with code" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---- certs ----------------------------------------------------------------------------------
def test_certs_out_is_a_file_does_not_suggest_force(tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep me")
    r = cachectl("certs", "--out", str(f), "--force")
    assert r.returncode == 1
    assert "--force" not in r.stderr and "not a directory" in r.stderr, r.stderr
    assert f.read_text() == "keep me"
