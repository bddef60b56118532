"""RocksDB writes that wait out a write stop in Python, not inside RocksDB.

RocksDB stops writes while flushes or compactions lag too far behind (too many
L0 files or memtables, too many pending compaction bytes: diskbudget.size_lsm
sets those limits), and a write issued then waits inside RocksDB until the stop
ends. rocksdict keeps the GIL through a write (0.3.29: a thread that only
ticked froze for the whole stop), so that wait froze every thread of the
server, gets included. Here a write goes in with no_slowdown, which RocksDB
refuses at once ("Write stall") instead of waiting; while writes are stopped
the writer sleeps, GIL released, and tries again (with the store's lock held
where the write needs it, which gets do not: hitlog.py). A refusal never ends
in the caller: only other errors do, a failed store's included (RocksDB answers
those before it looks at stalls).

A slowdown (RocksDB pacing writes at some bytes per second) would hold the GIL
for its own delay and for any stop that begins during it, so the stores' options
have none (diskbudget.size_lsm: slowdown triggers at the stop triggers). Should
RocksDB pace writes anyway, it refuses a no_slowdown write for most of it and
each refusal pushes its pacing further, so there the write goes in as asked.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import rocksdict

STOPPED = "rocksdb.is-write-stopped"
DELAYED = "rocksdb.actual-delayed-write-rate"  # 0 unless RocksDB paces writes now
POLL_MIN_S = 0.001
POLL_MAX_S = 0.05  # a stop ends when a compaction does: tens of ms late is nothing next to it


def is_stall(e: Exception) -> bool:
    """A write refused for a stall (no_slowdown: Status::Incomplete "Write stall")."""
    return "Write stall" in str(e)


class Writes:
    """Writes with one set of write options; call with a function that builds the
    batch (a refused write consumed it: a retry builds it again)."""

    def __init__(self, db: rocksdict.Rdict, opts: rocksdict.WriteOptions) -> None:
        self.db = db
        self.opts = opts
        self.quick = rocksdict.WriteOptions()
        self.quick.sync, self.quick.disable_wal = opts.sync, opts.disable_wal
        self.quick.no_slowdown = True

    def __call__(self, build: Callable[[], rocksdict.WriteBatch]) -> None:
        db, pause = self.db, 0.0
        while True:
            if db.property_int_value(DELAYED) and not db.property_int_value(STOPPED):
                db.write(build(), self.opts)  # paced: a short delay, in RocksDB as before
                return
            try:
                db.write(build(), self.quick)
                return
            except Exception as e:  # RocksDB's errors are bare Exceptions
                if not is_stall(e):
                    raise
            pause = min(POLL_MAX_S, pause * 2 or POLL_MIN_S)
            time.sleep(pause)  # the GIL goes to other threads meanwhile


def puts(records: Sequence[tuple[bytes, bytes]], cf: rocksdict.ColumnFamily) -> rocksdict.WriteBatch:
    """A batch of (key, record) puts into one column family."""
    wb = rocksdict.WriteBatch(raw_mode=True)
    for key, record in records:
        wb.put(key, record, cf)
    return wb
