"""Review of the store's space management.

* A RocksDB write stop that nothing ends (cacheserver/stallwrite.py) ends puts with a
  clear error, refuses puts while it lasts, lets go once RocksDB writes again, and never
  keeps a flush or a close (SIGTERM) waiting. Each such scenario runs in its own process:
  a write or flush left waiting for ever fails the test by its timeout.
* A put that no eviction and no compaction can make room for is refused at once
  (cacheserver/diskadmit.py), not after DISK_WAIT_S.
* A data dir that lost CURRENT is refused until --salvage, which keeps every value
  (cacheserver/salvage.py)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import cacheserver

CODE = os.path.dirname(os.path.dirname(os.path.abspath(cacheserver.__file__)))  # the tree under test


def run_script(script: str, *args: str, timeout: float = 90) -> dict:
    env = dict(os.environ, PYTHONPATH=CODE)
    try:
        run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"the store waited for ever on a write stop; progress: {out[-2000:]}") from None
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


COMMON = textwrap.dedent("""
    import json, os, sys, threading, time
    from cacheserver import stallwrite
    from cacheserver.counters import Counters
    from cacheserver.eviction import LRUPolicy
    from cacheserver.store import OVERHEAD, Store

    r = {}

    def note(**kw):  # progress, for the timeout's message
        r.update(kw)
        print(json.dumps(kw), flush=True)

    def timed(fn):
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            out = f"{type(e).__name__}: {e}"
        return round(time.monotonic() - t0, 2), out

    def in_thread(fn, timeout):
        out = []
        th = threading.Thread(target=lambda: out.append(timed(fn)), daemon=True)
        th.start()
        th.join(timeout)
        return out[0] if out else None
""")

# Writes stopped with no compaction due (level 0 past the stop trigger, its compaction
# trigger above the files there): nothing RocksDB does ends the stop.
NOTHING_DUE = COMMON + textwrap.dedent("""
    stallwrite.STUCK_S = 1.0
    s = Store(sys.argv[1], 8 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    db = s._db
    db.set_options({"disable_auto_compactions": "true"})
    ks = [os.urandom(32) for _ in range(8)]
    for i in range(0, 8, 2):  # full, and 4 table files in level 0
        s.put_many([(k, b"v" * 1000) for k in ks[i:i + 2]])
        s.flush()
    stop = {"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "3",
            "level0_stop_writes_trigger": "3", "disable_auto_compactions": "false"}
    db.set_options(stop)
    note(stopped=db.property_int_value("rocksdb.is-write-stopped"))
    note(first=in_thread(lambda: s.put_many([(os.urandom(32), b"n" * 1000)]), 30))  # must evict: under the lock
    note(state=s.room.state)
    note(second=in_thread(lambda: s.put_many([(os.urandom(32), b"n" * 1000)]), 30))
    note(get=in_thread(lambda: [bytes(v) for v in s.get_many(ks[6:8])] == [b"v" * 1000] * 2, 10))
    db.set_options({"level0_slowdown_writes_trigger": "100", "level0_stop_writes_trigger": "100"})
    note(after=in_thread(lambda: s.put_many([(os.urandom(32), b"a" * 1000)]), 30))
    s.put_many([(os.urandom(32), b"m" * 1000)])  # unflushed: the close's flush would wait for the stop
    db.set_options(stop)
    note(stopped_again=db.property_int_value("rocksdb.is-write-stopped"))
    note(close=in_thread(s.close, 60))
    note(rejected=s.counters["rejected_disk_full"])
    print(json.dumps(r))
""")


def test_a_write_stop_nothing_ends_fails_the_put_clearly_and_lets_go_after(tmp_path):
    r = run_script(NOTHING_DUE, str(tmp_path / "s"))
    assert r["stopped"] == 1, r
    took, err = r["first"]
    assert took < 20 and err.startswith("WriteStopped: ") and "no flush or compaction" in err, r
    assert r["state"] == "ok", r  # not failed for good: RocksDB may write again
    took, answer = r["second"]
    assert took < 0.5 and answer == [0, 0, 1], r  # refused at once while the stop holds
    assert r["get"][1] is True, r  # reads go on
    assert r["after"][1] == [1, 0, 0], r  # writes go on again: so do puts
    assert r["stopped_again"] == 1 and r["close"] is not None and r["close"][0] < 30, r
    assert r["rejected"] >= 1, r


# The practical case: something else fills the file system while a compaction runs at
# the write stop (level 0 full), and the compaction fails for lack of room. RocksDB then
# compacts nothing until the room that compaction needs is free (retrying each second):
# writes stay stopped, and a flush waits inside RocksDB, for as long as the disk stays full.
# Script helpers on a small file system at `top`: its free bytes; and the practical stop below
# (ballast fills it, compactions run, the one at the stop fails for lack of room, then room
# for a flush or small puts, not for that compaction, is freed). Returns the ballast's path.
FULL_DISK = textwrap.dedent("""
    import errno

    def free():
        st = os.statvfs(top)
        return st.f_bavail * st.f_frsize

    def settled(views, timeout=30):
        # RocksDB's own flushes and compactions of the column families that compact by themselves
        # (the store's flushes leave some due) done first: one that wrote meanwhile took the margin
        # below, and the ballast's write failed (ENOSPC), not the compaction
        deadline = time.monotonic() + timeout
        running = ("rocksdb.num-running-flushes", "rocksdb.num-running-compactions")  # of every family

        def busy():
            return (any(views[0].property_int_value(p) for p in running)
                    or any(v.property_int_value("rocksdb.compaction-pending") for v in views[1:]))
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)

    def fill(ballast, leave):
        # in steps, each to what is free then: a file that something else (RocksDB's info log,
        # a compaction) grew meanwhile leaves less; a step that no longer fits is the disk full
        with open(ballast, "ab", buffering=0) as f:
            while free() > leave + (64 << 10):
                try:
                    f.write(b"\\0" * min(free() - leave, 8 << 20))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break

    def fail_a_compaction(db):
        ballast = os.path.join(top, "ballast")
        settled((db, s._meta, s._server, s._large))
        fill(ballast, 1 << 20)
        try:
            db.set_options({"disable_auto_compactions": "false"})
        except Exception as e:  # set, but its OPTIONS file not written for lack of room (the point here)
            if "Unable to persist options" not in str(e):
                raise
        deadline = time.monotonic() + 20
        while not db.property_int_value("rocksdb.background-errors") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.truncate(ballast, max(0, os.path.getsize(ballast) - (3 << 20)))
        return ballast
""")

NO_ROOM = COMMON + FULL_DISK + textwrap.dedent("""
    stallwrite.STUCK_S = 2.0
    top = sys.argv[1]
    s = Store(os.path.join(top, "st"), 40 << 20, LRUPolicy(), Counters())
    db = s._db
    db.set_options({"disable_auto_compactions": "true"})
    kept = {}
    for f in range(4):  # 4 table files in level 0: the stop at this capacity, once compactions run
        items = [(os.urandom(32), os.urandom(100_000)) for _ in range(20)]
        s.put_many(items)
        kept.update(items)
        s.flush()
    s.put_many([(os.urandom(32), b"u" * 1000)])  # one not flushed yet
    ballast = fail_a_compaction(db)
    note(errors=db.property_int_value("rocksdb.background-errors"), free=free(),
         stopped=db.property_int_value("rocksdb.is-write-stopped"))
    note(flush=in_thread(s.flush, 20))  # RocksDB held it for the stop: for ever
    note(put=in_thread(lambda: s.put_many([(os.urandom(32), os.urandom(20_000))]), 30))
    note(refused=in_thread(lambda: s.put_many([(os.urandom(32), b"x" * 1000)]), 30))
    note(reads=in_thread(lambda: all(bytes(v) == kept[k] for k, v in zip(kept, s.get_many(list(kept)))), 30))
    os.unlink(ballast)  # room again: RocksDB compacts, and writes go on
    back, deadline = None, time.monotonic() + 40
    while time.monotonic() < deadline:
        back = in_thread(lambda: s.put_many([(os.urandom(32), b"y" * 1000)]), 30)
        if back is not None and back[1] == (1, 0, 0):
            break
        time.sleep(0.5)
    note(back=back, state=s.room.state, stopped_after=db.property_int_value("rocksdb.is-write-stopped"), l0=db.property_int_value("rocksdb.num-files-at-level0"), errors_after=db.property_int_value("rocksdb.background-errors"))
    note(close=in_thread(s.close, 60))
    print(json.dumps(r))
""")


def test_compactions_without_disk_room_end_puts_and_flushes_and_recover(small_fs):
    r = run_script(NO_ROOM, str(small_fs), timeout=200)
    assert r["errors"] >= 1 and r["stopped"] == 1, r  # the compaction did fail for lack of room
    assert r["flush"] is not None and r["flush"][0] < 5, r  # skipped, not waited for ever
    took, err = r["put"]
    assert took < 25 and err.startswith("WriteStopped: "), r
    assert "compactions fail" in err and "free now" in err, r
    assert r["refused"][0] < 0.5 and r["refused"][1] == [0, 0, 1], r
    assert r["reads"][1] is True, r
    assert r["back"] is not None and r["back"][1] == [1, 0, 0] and r["state"] == "ok", r
    assert r["close"] is not None and r["close"][0] < 30, r


def _fill_until_refused(s, tag=("", -1), batches=200):
    """Puts of 8 x 100 KB, then of one, until one is refused (the files on disk leave no room)."""
    n = 8
    for _ in range(batches):
        if s.put_many([(os.urandom(32), os.urandom(100_000)) for _ in range(n)], tag)[2]:
            if n == 1:
                return
            n = 1
    raise AssertionError("the store never filled up")


@pytest.mark.parametrize("case", ["no-eviction", "protected", "spare"])
def test_a_put_nothing_can_make_room_for_is_refused_at_once(tmp_path, case):
    """A full store where nothing may be evicted for a put (--eviction none, referenced
    chunks, a spare put among chunk entries) and no evicted bytes wait for a compaction:
    waiting for the disk (diskadmit.make_room, DISK_WAIT_S) cannot make room, so the put is
    refused at once; it waited 5 s first, every put, stalling the job's loader."""
    import time

    from cacheserver.counters import Counters
    from cacheserver.eviction import LRUPolicy, NoEviction
    from cacheserver.store import Store

    s = Store(str(tmp_path / "s"), 40 << 20, NoEviction() if case == "no-eviction" else LRUPolicy(), Counters())
    try:
        if case != "no-eviction":  # full of a referenced chunk
            s.set_protector(lambda tag: tag == ("ds", 0))
        _fill_until_refused(s, ("ds", 0) if case != "no-eviction" else ("", -1))
        s.flush()
        put_tag = {"no-eviction": ("", -1), "protected": ("ds", 0), "spare": ("ds", -1)}[case]
        if case == "spare":  # no longer referenced: a spare put still evicts only its kind
            s.set_protector(lambda tag: False)
        _fill_until_refused(s, put_tag)  # the flush and compactions meanwhile may have left room
        refused = 0
        for _ in range(3):
            t0 = time.monotonic()
            if s.put_many([(os.urandom(32), os.urandom(100_000))], put_tag) == (0, 0, 1):
                refused += 1
                assert time.monotonic() - t0 < 1.0, f"a refused put waited {time.monotonic() - t0:.1f} s"
        assert refused
    finally:
        s.close()


def test_a_lost_current_file_is_refused_until_salvage_keeps_every_value(tmp_path):
    """Without CURRENT (the file naming the MANIFEST) RocksDB took the data dir for a new
    store: the first start refused over the log file, but had written an empty MANIFEST,
    so a restart, with --salvage too, started empty and deleted every table file."""
    import hashlib

    import numpy as np

    from cacheserver.client.server_client import ServerClient
    from procs import ROOT, cacheserver as daemon

    data = str(tmp_path / "d")
    put = {}
    for run in range(2):
        s = daemon(data, "200MB").start()
        with ServerClient(s.address, local_read=False) as c:
            for b in range(4):
                vals = [np.random.default_rng([run, b, k]).bytes(32 << 10) for k in range(4)]
                items = [(hashlib.sha256(v).digest(), v) for v in vals]
                c.put(items)
                put.update(items)
        assert s.stop() == 0
    os.unlink(os.path.join(data, "db", "CURRENT"))
    argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", "127.0.0.1:0", "--data-dir", data,
            "--capacity", "200MB", "--log-format", "text"]
    for _ in range(2):  # refused, and refused again: nothing was changed
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "the store is damaged: file CURRENT" in lines[0] and "--salvage" in lines[0], lines
    s = daemon(data, "200MB", 0, "--salvage").start()
    try:
        with ServerClient(s.address, local_read=False) as c:
            got = c.get(list(put))
            assert all(v is not None and bytes(v) == put[k] for k, v in zip(put, got))
            assert c.stats().items == len(put)
    finally:
        assert s.stop() == 0
