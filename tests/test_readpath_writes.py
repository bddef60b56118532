"""A same-host client off its follower (REMOTE) while a real server takes inserts whose
values skip the log (--durability cache, the default): it must stay off, not reopen a
follower at every look (readpath.py), and come back once the writes stop."""
import os
import time

import pytest

from cacheserver.client import readpath
from cacheserver.client.localread import written_files
from cacheserver.client.readpath import LOCAL, QUIET_BYTES, REMOTE
from cacheserver.client.server_client import ServerClient
from procs import cacheserver


def _log_bytes(db_path: str) -> int:
    return sum(n for name, n in written_files(db_path).items() if name.endswith(".log"))


# 8MB: 1 MiB memtables, flushed every few puts; 150 KB values go to the table files followers
# open, 300 KB ones (>= diskbudget.BLOB_MIN) to blob files, while each flush still writes small
# table files of their index entries that followers open. 2GB: 16 MiB memtables
# (diskbudget.lsm_sizes): for seconds of inserts only the values' index entries reach the files.
@pytest.mark.parametrize("capacity,size,per_put,gap", [("8MB", 150_000, 8, 0.0), ("8MB", 300_000, 8, 0.0),
                                                        ("2GB", 25_000, 32, 0.06)])
def test_a_remote_client_stays_off_the_follower_while_inserts_go_on(tmp_path, capacity, size, per_put, gap):
    srv = cacheserver(str(tmp_path / "srv"), capacity).start()
    try:
        ids = [bytes([i]) * 32 for i in range(1, 9)]
        with ServerClient(srv.address) as c, ServerClient(srv.address, local_read=False) as w:
            w.put([(k, os.urandom(50_000)) for k in ids])
            c.get(ids)
            assert c.transport == "local" and c._db_path is not None
            db = c._db_path
            c.paths._hold = 3600.0  # the hold cannot end here: only the writes decide
            c.paths.follower(1.0)  # a losing window
            assert c.paths.decide() == REMOTE
            log0, opens, n = _log_bytes(db), c.paths.stats.follower_s, 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5 * readpath.QUIET_CHECK and n < 500:
                w.put([(os.urandom(32), os.urandom(size)) for _ in range(per_put)])  # 0.8-2.4 MB
                assert [v is not None for v in c.get(ids)] == [True] * 8
                n += 1
                time.sleep(gap)
            # the log alone grew too little to tell (the rule before: it read as "writes stopped")
            assert _log_bytes(db) - log0 < QUIET_BYTES
            assert c.paths.state == REMOTE and c._local is None
            assert c.paths.stats.follower_s == opens  # no follower was opened meanwhile
            # the writes stop: once the flusher and compactions are done, the files go quiet
            deadline = time.monotonic() + 60
            while c.paths.state == REMOTE and time.monotonic() < deadline:
                c.get(ids)
                time.sleep(0.05)
            assert c.paths.state == LOCAL
            assert [v is not None for v in c.get(ids)] == [True] * 8
    finally:
        srv.kill()


def test_written_files_stats_logs_and_new_table_files_only(tmp_path):
    files = (("000007.log", 300), ("000008.sst", 1000), ("000009.sst", 2000), ("LOG", 50), ("MANIFEST-000005", 70))
    for name, n in files:
        (tmp_path / name).write_bytes(b"x" * n)
    first = written_files(str(tmp_path))
    assert first == {"000007.log": 300, "000008.sst": 1000, "000009.sst": 2000}
    (tmp_path / "000007.log").write_bytes(b"x" * 900)  # the log grows
    (tmp_path / "000009.sst").unlink()  # compacted away
    (tmp_path / "000010.sst").write_bytes(b"x" * 4000)  # its output
    # a known table file keeps its known size (written once: not statted again)
    again = written_files(str(tmp_path), {**first, "000008.sst": 999})
    assert again == {"000007.log": 900, "000008.sst": 999, "000010.sst": 4000}
    assert written_files(str(tmp_path / "gone")) == {}


def test_a_table_file_seen_while_being_written_counts_until_it_stops_growing(tmp_path):
    """RocksDB writes a table file under its final name: a look may catch a flush's or a
    compaction's output half-written; its growth after that is writing too."""
    clock = [0.0]
    p = readpath.ReadPaths(lambda: clock[0])
    p._hold = 3600.0
    p.follower(1.0)
    assert p.decide() == REMOTE
    out = tmp_path / "000020.sst"

    def look() -> bool:
        clock[0] += readpath.QUIET_CHECK
        return p.use_local(written_files(str(tmp_path), p.files_finished))

    out.write_bytes(b"x" * 1000)  # the compaction has begun
    assert not look()  # the first look only records the files
    for _ in range(3):
        with open(out, "ab") as f:
            f.write(b"x" * (2 * QUIET_BYTES))  # ...and goes on
        assert not look()
    assert look()  # done: it stopped growing


def test_blob_files_count_as_writes(tmp_path):
    """Values of diskbudget.BLOB_MIN bytes and more go to blob files: followers never read
    them, but each flush of them writes table files of their index entries, which they open."""
    clock = [1.0]
    p = readpath.ReadPaths(lambda: clock[0])
    p._hold = 3600.0
    p.follower(1.0)
    assert p.decide() == REMOTE
    (tmp_path / "000010.log").write_bytes(b"x" * 100)
    assert not p.use_local(written_files(str(tmp_path), p.files_finished))
    (tmp_path / "000011.blob").write_bytes(b"x" * (4 * QUIET_BYTES))
    clock[0] += readpath.QUIET_CHECK
    assert not p.use_local(written_files(str(tmp_path), p.files_finished))
    assert p.state == REMOTE
    clock[0] += readpath.QUIET_CHECK
    assert p.use_local(written_files(str(tmp_path), p.files_finished))  # the writes stopped
