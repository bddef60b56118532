"""The daemons' signal handling and two benchmarks' checks of what they measure, with real
processes: a SIGTERM after Ctrl-C's SIGINT (`make demo`'s clean-up) killed a daemon that
had drained and was exiting (-15); tools/bench/grpccall timed a server that had refused its
item (misses); tools/bench/hitpath's memcached evicted silently past a fixed -m."""
import os
import random
import shutil
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.client.server_client import ServerClient  # noqa: E402
import procs  # noqa: E402
from procs import cacheserver, cachemanager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "tools", "bench")


def load_bench(name: str):
    sys.path.insert(0, BENCH)  # the scripts import benchargs from beside them
    return procs.load_script(os.path.join(BENCH, name), f"mlcache_bench_{name}")


def interrupt_then_terminate(daemon: procs.Daemon) -> int:
    """SIGINT (Ctrl-C), then SIGTERM every 2 ms until the daemon exits (30 s at most), so that
    some land during its drain and some while it exits; its exit code."""
    daemon.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while daemon.proc.poll() is None and time.monotonic() < deadline:
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    try:
        return daemon.proc.wait(5)
    finally:
        daemon.kill()


@pytest.mark.timeout(120)
def test_sigterm_after_sigint_leaves_the_server_exiting_cleanly_with_its_data(tmp_path):
    rng = random.Random(3)
    ks, vs = [rng.randbytes(32) for _ in range(200)], [rng.randbytes(2000) for _ in range(200)]
    data = str(tmp_path / "srv")
    for attempt in range(3):  # the exit's last steps are short: each try sends SIGTERMs through them
        srv = cacheserver(data, "256MB").start()
        if attempt == 0:
            with ServerClient(srv.address) as c:
                assert c.put(list(zip(ks, vs))) == (200, 0, 0)
        rc = interrupt_then_terminate(srv)
        with open(srv.log_path) as f:
            log = f.read()
        assert rc == 0 and "Traceback" not in log, (rc, log[-2000:])
    srv = cacheserver(data, "256MB").start()  # reopened: every value flushed, none lost to the signals
    try:
        with ServerClient(srv.address) as c:
            assert [bytes(v) if v is not None else None for v in c.get(ks)] == vs
    finally:
        assert srv.stop() == 0


@pytest.mark.timeout(120)
def test_sigterm_after_sigint_leaves_the_manager_exiting_cleanly(tmp_path):
    for _ in range(3):
        m = cachemanager(str(tmp_path / "mgr")).start()
        rc = interrupt_then_terminate(m)
        with open(m.log_path) as f:
            log = f.read()
        assert rc == 0 and "Traceback" not in log, (rc, log[-2000:])


@pytest.mark.timeout(120)
def test_grpccall_fails_loudly_when_the_server_refuses_its_item(tmp_path, monkeypatch, capsys):
    bench = load_bench("grpccall")
    started = []

    def full_server(tree, data):  # a server with no room for the bench's 4 KB item: puts are refused
        started.append(procs.cacheserver(data, "1KB", 0, "--unix-socket", "off", "--eviction", "none").start())
        return started[-1]

    monkeypatch.setattr(sys, "argv", ["grpccall", "--against", "", "--rounds", "1", "--calls", "1"])
    bench.main()  # a server with room: figures and the ratio line
    assert "ratio 1.000" in capsys.readouterr().out
    monkeypatch.setattr(bench, "start", full_server)
    with pytest.raises(SystemExit, match="did not store the item .*refused 1"):
        bench.main()
    assert "ratio" not in capsys.readouterr().out
    assert started and started[0].proc.poll() is not None  # the bench stopped its server


needs_memcached = pytest.mark.skipif(shutil.which("memcached") is None, reason="memcached is not installed")


@needs_memcached
@pytest.mark.timeout(120)
def test_hitpath_refuses_a_memcached_that_evicted(tmp_path):
    """-m 32 (the least that -I 16m allows) holds ~256 items of 110 KiB: of 280, memcached takes
    every set and drops the oldest; the bench said nothing and read fewer bytes from it."""
    from pymemcache.client.base import Client

    hp = load_bench("hitpath")
    port, size, n = hp.free_port(), 110 << 10, 280
    p = hp.subprocess.Popen(["memcached", "-p", str(port), "-l", "127.0.0.1", "-m", "32", "-I", "16m", "-U", "0"]
                            + (["-u", "root"] if os.getuid() == 0 else []))
    try:
        hp.wait_port(port)
        mc = Client(("127.0.0.1", port))
        value = os.urandom(size)
        for i in range(n):
            assert mc.set(f"k{i}", value, noreply=False)
        with pytest.raises(SystemExit, match=f"holds \\d+ of the {n} items \\([1-9]\\d* evicted\\)"):
            hp.check_memcached_holds(mc, n, 32)
        mc.close()
    finally:
        p.kill()
        p.wait(10)


@needs_memcached
@pytest.mark.timeout(120)
def test_hitpath_sizes_memcached_for_its_items(tmp_path):
    """600 items of 110 KiB (66 MB; memcached's default -m is 64): the -m the bench now
    derives from the items holds them all, and the check passes."""
    from pymemcache.client.base import Client

    hp = load_bench("hitpath")
    port, size, n = hp.free_port(), 110 << 10, 600
    assert hp.memcached_mb(40_000, size) * 2**20 > 40_000 * size * 1.25  # past the fixed 4096 MB
    p, mb = hp.start_memcached(shutil.which("memcached"), port, n, size)
    try:
        hp.wait_port(port)
        mc = Client(("127.0.0.1", port))
        value = os.urandom(size)
        for i in range(n):
            mc.set(f"k{i}", value, noreply=False)
        hp.check_memcached_holds(mc, n, mb)
        mc.close()
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.timeout(60)
def test_hitpath_refuses_puts_the_cacheserver_did_not_store(tmp_path):
    hp = load_bench("hitpath")
    srv = cacheserver(str(tmp_path / "srv"), "1KB", 0, "--eviction", "none").start()
    try:
        with ServerClient(srv.address) as c:
            answers = [c.put([(os.urandom(32), os.urandom(4096))]) for _ in range(2)]
        with pytest.raises(SystemExit, match="stored 0 of the 2 items \\(2 refused\\)"):
            hp.check_stored(answers, 2, "the cacheserver")
    finally:
        srv.stop()
