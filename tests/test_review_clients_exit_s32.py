"""Review (s32): a process exiting right after CachedDataset.close() while a store read is
stuck ends within the exit's bound (clients/procstate.py) whatever the store: s3 through
s3fs against a real moto server behind a held proxy, and a local file whose read never
returns (a FIFO nobody writes); a daemon thread blocked in a local read holds no exit."""
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from procs import cachemanager, cacheserver, wait_ring  # noqa: E402
from test_dataset import make_dataset  # noqa: E402
from test_review_clients_s31 import _EXIT_AFTER_CLOSE, exit_handlers_took  # noqa: E402

from clients.digest import Digest  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from clients.procstate import BROKEN_WAIT_S, EXIT_WAIT_S  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
BOUND_S = EXIT_WAIT_S + BROKEN_WAIT_S + 2.0  # as test_review_clients_s31's HTTP case


def _exit_after_close(tmp_path, digest: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run _EXIT_AFTER_CLOSE (a job whose coordinator is amid a store read when close()
    returns, and which exits at once) against a real manager; (its result, seconds from
    close() returning to its exit handlers' end; the process's end is checked here). Killed after 60 s: a hung exit fails."""
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "500kB", "--chunk-size", "100kB").start()
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address, "--claim-ttl", "60").start()
    try:
        wait_ring(m.address, 1)
        env = dict(os.environ, PYTHONPATH=REPO, PYTHONFAULTHANDLER="1", **env)
        env[DIR_ENV] = str(tmp_path / "tokens")
        try:
            p = subprocess.run([sys.executable, "-c", _EXIT_AFTER_CLOSE, digest, m.address, TESTS],
                               capture_output=True, text=True, timeout=60, env=env)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the process did not exit within 60 s of its start: {e.stdout!r} {e.stderr!r}")
        ended = time.monotonic()
    finally:
        srv.kill()
        m.kill()
    return p, exit_handlers_took(p, ended)


def test_exit_after_close_amid_a_stuck_s3_read_is_bounded(tmp_path):
    """s3fs against moto, its requests held by a proxy (a store that never answers): the
    exit broke no s3 read (only an HTTP/GCS session was closed), and s3fs's own timeouts
    and retries ran on long past the bound."""
    pytest.importorskip("moto")
    from test_digest_s3 import CREDS, endpoint_process, free_port
    from test_review_evictions import PausableProxy
    s3fs = pytest.importorskip("s3fs")

    path, _ = make_dataset(tmp_path / "ds", n=1000, lo=1_000, hi=1_000)
    port = free_port()
    with endpoint_process(["moto_server", "-H", "127.0.0.1", "-p", str(port)], port,
                          str(tmp_path / "moto.log")) as url:
        s3 = s3fs.S3FileSystem(endpoint_url=url, skip_instance_cache=True, **CREDS)
        s3.mkdir("mlcache-exit")
        s3.put(str(tmp_path / "ds") + "/", "mlcache-exit/ds/", recursive=True)
        d = Digest.load(path)
        d.root = "s3://mlcache-exit/ds"
        d.save(str(tmp_path / "s3.digest"))
        proxy = PausableProxy(url.removeprefix("http://"))
        proxy.open.clear()  # every request to the store waits: a read in flight never ends
        try:
            p, took = _exit_after_close(tmp_path, str(tmp_path / "s3.digest"), {
                "AWS_ENDPOINT_URL": "http://" + proxy.address, "AWS_ACCESS_KEY_ID": CREDS["key"],
                "AWS_SECRET_ACCESS_KEY": CREDS["secret"]})
        finally:
            proxy.close()
    assert took < BOUND_S, f"exit handlers ran {took:.1f} s after close() returned"
    assert "Traceback" not in p.stderr, p.stderr


def _fifo_store(tmp_path) -> str:
    """A local digest whose files are FIFOs nobody writes: a read of one never returns
    (as on a hung mount); the digest's path."""
    path, _ = make_dataset(tmp_path / "ds", n=1000, lo=1_000, hi=1_000)
    for name in os.listdir(tmp_path / "ds"):
        os.unlink(tmp_path / "ds" / name)
        os.mkfifo(tmp_path / "ds" / name)
    return path


def test_exit_after_close_amid_a_stuck_local_read_is_bounded(tmp_path):
    """A local read that never returns (in the store-fetch pool): the exit joined that pool's
    threads without a bound (concurrent.futures), and the process never ended."""
    p, took = _exit_after_close(tmp_path, _fifo_store(tmp_path), {})
    assert took < BOUND_S, f"exit handlers ran {took:.1f} s after close() returned"
    assert "Traceback" not in p.stderr, p.stderr


_DAEMON_READ = """
import sys, threading, time
sys.path.insert(0, sys.argv[2])
from test_review_clients_s31 import _in
from clients.dataset import CachedDataset
ds = CachedDataset(sys.argv[1], cache=False)
t = threading.Thread(target=ds.read, args=(list(range(16)),), daemon=True)
t.start()
deadline = time.monotonic() + 30
while not _in(t, "read_items") and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # into the pool's reads
print("in a store read:", _in(t, "read_items"), flush=True)
print("returning at", time.monotonic(), flush=True)
"""


def test_a_daemon_thread_blocked_in_a_local_read_holds_no_exit(tmp_path):
    """The user's daemon thread reads (no close()): its reads sat in the store-fetch pool,
    whose threads the exit joined without a bound."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONFAULTHANDLER="1")
    try:
        p = subprocess.run([sys.executable, "-c", _DAEMON_READ, _fifo_store(tmp_path), TESTS],
                           capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit within 60 s of its start: {e.stdout!r} {e.stderr!r}")
    took = time.monotonic() - float(p.stdout.split("returning at")[1])
    assert p.returncode == 0, p.stderr
    assert "in a store read: True" in p.stdout, p.stdout
    assert took < 5.0, f"exited {took:.1f} s after its main thread returned"
