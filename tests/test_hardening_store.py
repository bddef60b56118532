"""Issue 12: the store's files damaged or its disk full, through real daemons."""
import glob
import hashlib
import os
import subprocess
import sys

import numpy as np

from cacheserver.client.server_client import ServerClient
from procs import ROOT, cacheserver


def _fill(address: str, batches: int, per: int, size: int, seed: int = 0) -> dict[bytes, bytes]:
    put = {}
    with ServerClient(address) as c:
        for b in range(batches):
            items = []
            for k in range(per):
                v = np.random.default_rng([seed, b, k]).bytes(size)  # incompressible
                items.append((hashlib.sha256(v).digest(), v))
            c.put(items)
            put.update(items)
    return put


def _read_back(address: str, put: dict[bytes, bytes]) -> int:
    """How many of ``put`` the server still holds; any held value must be exact."""
    with ServerClient(address) as c:
        ids = list(put)
        got = c.get(ids)
    held = 0
    for i, v in zip(ids, got):
        if v is not None:
            assert bytes(v) == put[i], "a damaged store delivered wrong bytes"
            held += 1
    return held


def test_truncated_sst_one_line_error_then_salvage(tmp_path):
    data = str(tmp_path / "d")
    put = {}
    for run in range(2):  # two runs: two table files of values, one to damage
        s = cacheserver(data, "200MB").start()
        put.update(_fill(s.address, batches=6, per=4, size=32 << 10, seed=run))  # < 1 MiB: one flush a run
        assert s.stop() == 0
    # the newest file that holds values: older ones are compacted together, so
    # damaging it leaves the rest readable
    ssts = [f for f in sorted(glob.glob(os.path.join(data, "db", "*.sst"))) if os.path.getsize(f) > 100_000]
    victim = ssts[-1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir", data,
            "--capacity", "200MB", "--log-format", "text"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cacheserver: error: the store is damaged: file "), lines
    assert os.path.basename(victim) in lines[0] and "--salvage" in lines[0] and "start empty" in lines[0]

    s = cacheserver(data, "200MB", 0, "--salvage").start()
    try:
        held = _read_back(s.address, put)
        assert 0 < held < len(put)  # the readable part kept, the rest dropped
        with ServerClient(s.address) as c:
            st = c.stats()
            assert st.items == held and st.used_bytes <= st.capacity_bytes
        assert not os.path.exists(os.path.join(data, "db", "lost"))
        more = _fill(s.address, batches=2, per=2, size=64 << 10, seed=1)
        assert _read_back(s.address, more) == len(more)
    finally:
        assert s.stop() == 0


def _fill_disk(path: str) -> None:
    with open(path, "wb") as f:
        try:
            for _ in range(1000):
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass  # ENOSPC: full


def test_disk_full_keeps_acknowledged_and_stats_true(small_fs):
    data = str(small_fs / "d")
    s = cacheserver(data, "40MB").start()
    try:
        first: dict[bytes, bytes] = {}
        for b in range(5):
            first.update(_fill(s.address, batches=1, per=4, size=256 << 10, seed=100 + b))
        _fill_disk(str(small_fs / "ballast"))  # at once: most of `first` is not flushed yet
        refused = 0
        with ServerClient(s.address) as c:
            for b in range(6):
                items = [(hashlib.sha256(bytes([b, k])).digest(), bytes([b, k]) * 1000) for k in range(4)]
                stored, _, rejected = c.put(items)
                assert stored == 0
                refused += rejected
            st = c.stats()
            assert st.items == len(first) and refused == 24
            assert st.counters["put_stored"] == len(first) and st.counters["rejected_disk_full"] == 24
        assert _read_back(s.address, first) == len(first)  # reads go on
        os.unlink(small_fs / "ballast")
        more = _fill(s.address, batches=1, per=2, size=1000, seed=7)
        assert _read_back(s.address, more) == len(more)  # room again: puts accepted
    finally:
        rc = s.stop()
    assert rc == 0
    log = open(os.path.join(data, "server.log")).read()
    assert "disk full: " in log and "puts are refused and reads go on" in log
    s = cacheserver(data, "40MB").start()
    try:
        assert _read_back(s.address, first) == len(first)  # nothing acknowledged was lost
        assert _read_back(s.address, more) == len(more)
    finally:
        assert s.stop() == 0
