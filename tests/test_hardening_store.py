"""Issue 12: the store's files damaged or its disk full, through real daemons."""
import glob
import hashlib
import os
import subprocess
import sys

import numpy as np

from cacheserver.client import ServerClient
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
        put.update(_fill(s.address, batches=6, per=4, size=128 << 10, seed=run))
        assert s.stop() == 0
    ssts = sorted(glob.glob(os.path.join(data, "db", "*.sst")), key=os.path.getsize)
    victim = ssts[-1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    argv = [sys.executable, "-m", "cacheserver.daemon", "--listen", "127.0.0.1:0", "--data-dir", data,
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
