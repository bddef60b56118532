"""A data dir the server cannot use for the machine's reasons (another user's files, a file in
its place) is refused in one line that says so, through real daemons; never called damage,
and --salvage then repairs nothing (its files are intact for the user they belong to)."""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from cacheserver.client.server_client import ServerClient
from procs import ROOT, cacheserver

NOBODY = 65534


def _serverd(data: str, *extra: str, as_nobody: bool = False) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir", data,
            "--capacity", "64MB", "--log-format", "text", *extra]
    if as_nobody:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cacheserver: error: "), lines
    return lines[0]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_users_store_is_named_as_such_and_salvage_drops_nothing():
    top = tempfile.mkdtemp(prefix="datadir-perm-")  # under /tmp: pytest's tmp_path is shut to other users
    try:
        os.chmod(top, 0o755)
        data = os.path.join(top, "d")
        s = cacheserver(data, "64MB").start()  # the store, made by root
        items = [(hashlib.sha256(v).digest(), v) for v in (np.random.default_rng(i).bytes(4000) for i in range(20))]
        with ServerClient(s.address) as c:
            c.put(items)
        assert s.stop() == 0

        os.chmod(data, 0o755)
        line = _one_line_error(_serverd(data, as_nobody=True))  # the dir's lock file is root's
        assert "store.lock" in line and "uid 0" in line and f"uid {NOBODY}" in line, line

        os.chmod(data, 0o777)  # the lock file open to all; RocksDB's files still root's alone
        os.chmod(os.path.join(data, "store.lock"), 0o666)
        for extra in ((), ("--salvage",)):
            line = _one_line_error(_serverd(data, *extra, as_nobody=True))
            assert "Permission denied" in line and "not damaged" in line and "the store is damaged" not in line, line
            assert "uid 0" in line and "restart with --salvage" not in line, line

        s = cacheserver(data, "64MB").start()  # its owner finds every item as it was
        try:
            with ServerClient(s.address) as c:
                got = c.get([k for k, _ in items])
            assert [bytes(v) if v is not None else None for v in got] == [v for _, v in items]
        finally:
            assert s.stop() == 0
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_data_dir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "afile"
    f.write_bytes(b"not a dir")
    for data in (str(f), str(f / "sub")):
        line = _one_line_error(_serverd(data))
        assert f"{f} is a file" in line, line
    assert f.read_bytes() == b"not a dir"


def test_a_store_another_process_holds_is_not_called_damaged(tmp_path):
    """A process other than a cache server (a tool, an older server) has the store's RocksDB open:
    the server says so, and --salvage neither repairs nor advises starting empty."""
    import rocksdict

    data = str(tmp_path / "d")
    s = cacheserver(data, "64MB").start()
    assert s.stop() == 0
    raw = rocksdict.Options(raw_mode=True)
    db = rocksdict.Rdict(os.path.join(data, "db"), raw, column_families={n: raw for n in ("meta", "server", "large")})
    try:
        for extra in ((), ("--salvage",)):
            line = _one_line_error(_serverd(data, *extra))
            assert "another process has this store open" in line and "not damaged" in line, line
            assert "start empty" not in line and "the store is damaged" not in line, line
    finally:
        db.close()
    s = cacheserver(data, "64MB").start()
    assert s.stop() == 0


def test_rocksdbs_lock_held_by_this_process_is_not_called_damage(tmp_path):
    """RocksDB's own words when this process holds the db already (an open not closed)."""
    import rocksdict

    from cacheserver.salvage import machine_problem
    db = str(tmp_path / "db")
    first = rocksdict.Rdict(db)
    try:
        with pytest.raises(Exception) as e:
            rocksdict.Rdict(db)
        line = machine_problem(db, e.value)
        assert line and "this process has this store open already" in line and "not damaged" in line, line
    finally:
        first.close()
