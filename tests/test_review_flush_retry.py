"""Review of the store's flushes that fail for a reason not RocksDB's (cacheserver/storeflush.py):

* A flush cleared the store's "dirty since" before flushing; one that failed making room for
  itself (diskroom.before_flush: the disk nearly full, the reserve file that would make room
  cannot be deleted) left it cleared, so the flusher never tried again until the next write:
  acknowledged values (durability "cache") stayed in the memtable only, lost to a kill, for
  as long as no put came, though the disk had room again.
* That error also went out of close()'s last flush, before RocksDB was released: its LOCK and
  the data dir's stayed held in this process (the embedded cache reopens the same dir).

Real failures: a small tmpfs filled by a ballast file, and the reserve file made undeletable
by a bind mount over it (unlink: EBUSY), as a file held by another mount namespace is.
"""
import contextlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store

CAPACITY = 40 << 20


@contextlib.contextmanager
def undeletable(path: str) -> Iterator[None]:
    """``path`` cannot be unlinked (EBUSY) while a file is bind-mounted over it."""
    if subprocess.run(["mount", "--bind", "/dev/null", path], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        yield
    finally:
        subprocess.run(["umount", path], check=True)


@contextlib.contextmanager
def nearly_full(s: Store, ballast: str) -> Iterator[None]:
    """The file system of ``s`` filled until its unflushed values no longer fit (the reserve
    would have to go first); emptied on the way out."""
    free = shutil.disk_usage(os.path.dirname(ballast)).free
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free - s._unflushed_bytes() // 2))
    try:
        yield
    finally:
        os.unlink(ballast)


def fail_a_flush(s: Store, small_fs, caplog) -> None:
    """Acknowledged values, then a flush that cannot make room for them. The flusher may flush
    them first if it runs between the puts and the ballast: then again (bounded)."""
    for _ in range(3):
        caplog.clear()
        flushes = s.counters["flushes"]
        assert s.put_many([(os.urandom(32), os.urandom(200_000)) for _ in range(4)]) == (4, 0, 0)
        with nearly_full(s, str(small_fs / "ballast")):
            try:
                s.flush()
                failed = any("making room" in r.getMessage() for r in caplog.records)
            except OSError:  # as it was before: the caller's to handle, the flusher's next tick
                failed = True
            if failed or s.counters["flushes"] == flushes:
                assert failed and s._unflushed, "the flush did not fail as set up"
                return
    pytest.fail("the flusher flushed before the disk was filled, 3 times")


def test_a_flush_that_failed_making_room_is_retried_once_there_is_room(small_fs, caplog):
    caplog.set_level(logging.WARNING, logger="cacheserver")
    s = Store(str(small_fs / "d"), CAPACITY, LRUPolicy(), Counters())
    try:
        with undeletable(s.room.reserve_path):
            fail_a_flush(s, small_fs, caplog)
        flushes, deadline = s.counters["flushes"], time.monotonic() + 10
        while s._unflushed and time.monotonic() < deadline:  # the flusher ticks every 0.1 s
            time.sleep(0.1)
        assert not s._unflushed and s.counters["flushes"] > flushes, \
            "room was back, but no flush was tried again: the values stay in the memtable only"
        said = [r.getMessage() for r in caplog.records if "flushing the store" in r.getMessage()]
        assert len(said) <= 2 and "works again" in said[-1], said  # not one line per retry
    finally:
        s.close()


def test_close_releases_the_store_when_its_last_flush_cannot_make_room(small_fs, caplog):
    caplog.set_level(logging.WARNING, logger="cacheserver")
    path = str(small_fs / "d")
    s = Store(path, CAPACITY, LRUPolicy(), Counters())
    kept = [(os.urandom(32), os.urandom(1000)) for _ in range(3)]
    assert s.put_many(kept) == (3, 0, 0)
    s.flush()
    assert s.put_many([(os.urandom(32), os.urandom(200_000)) for _ in range(4)]) == (4, 0, 0)
    with undeletable(s.room.reserve_path), nearly_full(s, str(small_fs / "ballast")):
        try:  # its last flush cannot make room (flushed by the flusher already or not: no room at all)
            s.close()  # raised OSError (EBUSY) out of that flush, RocksDB still open
        except Exception as e:  # RocksDB's own, from releasing it on a full disk, is said after
            assert type(e) is Exception, repr(e)
        assert any("making room" in r.getMessage() for r in caplog.records), "the last flush did not fail"
    again = Store(path, CAPACITY, LRUPolicy(), Counters())  # refused: "lock hold by current process"
    try:
        assert [bytes(v) for v in again.get_many([k for k, _ in kept])] == [v for _, v in kept]
        assert again.put_many([(os.urandom(32), b"n" * 1000)]) == (1, 0, 0)
    finally:
        again.close()
