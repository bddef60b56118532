"""RocksDB writes that wait out a write stop in Python, not inside RocksDB.

RocksDB stops writes while flushes or compactions lag too far behind (too many
L0 files or memtables, too many pending compaction bytes: diskbudget.size_lsm
sets those limits), and a write issued then waits inside RocksDB until the stop
ends. rocksdict keeps the GIL through a write (0.3.29: a thread that only
ticked froze for the whole stop), so that wait froze every thread of the
server, gets included. Here a write goes in with no_slowdown, which RocksDB
refuses at once ("Write stall") instead of waiting; while writes are stopped
the writer sleeps, GIL released, and tries again (with the store's lock held
where the write needs it, which gets do not: hitlog.py). Other errors end in
the caller, a failed store's included (RocksDB answers those before it looks
at stalls); a refusal only does for a stop that nothing RocksDB does will end
(Progress.stuck): its compactions fail, as one does without the disk room it
needs (RocksDB retries it each second until that room is free, and compacts
nothing else meanwhile), or no flush or compaction runs. Waiting that out held
puts, and the store's lock, for as long as the disk stayed full; now the write
fails after STUCK_S with WriteStopped, which says why. Until a write goes in
again, puts are refused at once while writes stay stopped (Progress.refusing),
and the store skips flushes while RocksDB is stuck: it would hold them inside
for the stop (Store.flush; a close cancels one held already).

A slowdown (RocksDB pacing writes at some bytes per second) would hold the GIL
for its own delay and for any stop that begins during it, so the stores' options
have none (diskbudget.size_lsm: slowdown triggers at the stop triggers). Should
RocksDB pace writes anyway, it refuses a no_slowdown write for most of it and
each refusal pushes its pacing further, so there the write goes in as asked.
"""
from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence

import rocksdict

from .sizes import format_size

STOPPED = "rocksdb.is-write-stopped"
DELAYED = "rocksdb.actual-delayed-write-rate"  # 0 unless RocksDB paces writes now
ERRORS = "rocksdb.background-errors"  # failed flushes and compactions since the store opened
RUNNING = ("rocksdb.num-running-compactions", "rocksdb.num-running-flushes")
POLL_MIN_S = 0.001
POLL_MAX_S = 0.05  # a stop ends when a compaction does: tens of ms late is nothing next to it
STUCK_S = 10.0  # a write gives up on a stop that nothing has been ending for this long
FAILING_S = 3.0  # RocksDB retries a compaction that failed for lack of room every second
log = logging.getLogger("cacheserver")


class WriteStopped(RuntimeError):
    """RocksDB stopped writes and nothing it does will end the stop (Progress.stuck)."""


def is_stall(e: Exception) -> bool:
    """A write refused for a stall (no_slowdown: Status::Incomplete "Write stall")."""
    return "Write stall" in str(e)


class Progress:
    """What RocksDB's background work does about a write stop; one per store, shared by its Writes."""

    def __init__(self, db: rocksdict.Rdict) -> None:
        self.db = db
        self._errors = db.property_int_value(ERRORS) or 0
        self._rose = float("-inf")  # when the count of background errors last rose
        self.gave_up: str | None = None  # why the last write gave up; None once a write goes in

    def failing(self) -> bool:
        """RocksDB's background errors rose within FAILING_S: its compactions fail now."""
        n, now = self.db.property_int_value(ERRORS) or 0, time.monotonic()
        if n > self._errors:
            self._errors, self._rose = n, now
        return now - self._rose < FAILING_S

    def stuck(self) -> str | None:
        """Why nothing RocksDB does now would end a write stop (one that holds, or one that
        a flush would begin), or None."""
        db = self.db
        if self.failing():
            free = format_size(shutil.disk_usage(db.path()).free)
            return (f"its compactions fail ({self._errors} background errors; RocksDB's LOG in {db.path()} "
                    f"says why: lack of disk room, {free} free now, where a compaction needs about its "
                    "input files' size)")
        if db.property_int_value(STOPPED) and not any(db.property_int_value(p) for p in RUNNING):
            return "no flush or compaction runs that would end it"
        return None

    def refusing(self) -> str | None:
        """Why a put is refused without trying: a write gave up, and writes are still stopped."""
        why = self.gave_up
        return why if why is not None and self.db.property_int_value(STOPPED) else None

    def went_in(self) -> None:
        if self.gave_up is not None:
            self.gave_up = None
            log.info("the store writes again: puts are accepted")

    def give_up(self, why: str) -> WriteStopped:
        msg = (f"RocksDB stopped the store's writes and {why}; puts are refused and reads go on "
               "until it writes again")
        if self.gave_up is None:
            log.error("%s", msg)
        self.gave_up = msg
        return WriteStopped(msg)


class Writes:
    """Writes with one set of write options; call with a function that builds the
    batch (a refused write consumed it: a retry builds it again)."""

    def __init__(self, db: rocksdict.Rdict, opts: rocksdict.WriteOptions, progress: Progress | None = None) -> None:
        self.db = db
        self.opts = opts
        self.quick = rocksdict.WriteOptions()
        self.quick.sync, self.quick.disable_wal = opts.sync, opts.disable_wal
        self.quick.no_slowdown = True
        self.progress = progress or Progress(db)

    def __call__(self, build: Callable[[], rocksdict.WriteBatch]) -> None:
        db, pause, stuck_since = self.db, 0.0, None
        while True:
            if db.property_int_value(DELAYED) and not db.property_int_value(STOPPED):
                db.write(build(), self.opts)  # paced: a short delay, in RocksDB as before
                self.progress.went_in()
                return
            try:
                db.write(build(), self.quick)
                self.progress.went_in()
                return
            except Exception as e:  # RocksDB's errors are bare Exceptions
                if not is_stall(e):
                    raise
            why = self.progress.stuck()
            now = time.monotonic()
            if why is None or stuck_since is None:  # stuck at every look since stuck_since
                stuck_since = None if why is None else now
            if why is not None and now - stuck_since >= STUCK_S:
                raise self.progress.give_up(why)
            pause = min(POLL_MAX_S, pause * 2 or POLL_MIN_S)
            time.sleep(pause)  # the GIL goes to other threads meanwhile

    def once(self, build: Callable[[], rocksdict.WriteBatch]) -> bool:
        """One try that waits for nothing (for a caller that must not wait: a get): whether the
        batch went in; False while writes are stopped or paced. RocksDB's other errors are raised."""
        db = self.db
        if db.property_int_value(STOPPED) or db.property_int_value(DELAYED):
            return False  # a paced write's refusal would push its pacing further
        try:
            db.write(build(), self.quick)
        except Exception as e:  # RocksDB's errors are bare Exceptions
            if is_stall(e):
                return False
            raise
        self.progress.went_in()
        return True


def puts(records: Sequence[tuple[bytes, bytes]], cf: rocksdict.ColumnFamily) -> rocksdict.WriteBatch:
    """A batch of (key, record) puts into one column family."""
    wb = rocksdict.WriteBatch(raw_mode=True)
    for key, record in records:
        wb.put(key, record, cf)
    return wb
