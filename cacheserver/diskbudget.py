"""Bytes on disk within --capacity (measured like `du`), not only logical bytes.

RocksDB keeps an evicted value on disk until a compaction merges its tombstone
into the file that holds it, and a compaction writes its outputs before it
deletes its inputs. Left alone, LRU churn held up to 2.4x --capacity on disk
(64 MiB store, 256 KiB items, 5x churn). Three parts bound it:

* size_lsm(): the LSM's sizes follow the capacity (memtables, table files, the
  level above the last), so one compaction rewrites a small part of the store,
  and RocksDB slows and then stops writes while compaction lags behind.
* DiskUse: the data dir's allocated bytes (st_blocks, as `du` counts them),
  table files apart, measured at most every MEASURE_EVERY_S.
* room(): a pure function of those measurements. A put is admitted only while
  what is on disk, plus what is not flushed yet, plus the put stays within
  the capacity less headroom() (room for the compaction running meanwhile); when
  the dead values on disk would not free enough once compacted, more entries
  are evicted (least recently used first), SLACK ahead, so that they will and
  puts go on while compactions free it. Until a compaction frees room, puts
  wait (Store: at most DISK_WAIT_S, then refused as rejected_full), and a
  slice of the key space is compacted if RocksDB is not compacting by itself.
Stores below MIN_BOUNDED keep only the logical bound.

Values of BLOB_MIN bytes and more live in RocksDB's blob files, out of the LSM:
compactions then move only their keys, where a 1 MiB value was rewritten 5-7
times on its way down the levels (puts waited on those compactions for room;
docs/benchmarks.md, tools/bench/diskchurn). A blob file goes once every value
in it is deleted, so a few long-lived (hit) values can pin files full of
evicted ones: the store then rewrites the oldest survivors (Store.relocate_oldest,
diskadmit.py) instead of evicting more. Smaller values stay in the LSM, where a
hit reads them without a copy (mmap).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass

import rocksdict

HEADROOM = 0.05  # of capacity at least: what a running compaction may add before it deletes its inputs
SLACK = 0.15  # of capacity: evicted ahead once full, so that puts go on while compaction frees it
TABLE_SLACK = 0.02  # table files' own bytes (index, filter, block padding) per byte of entries
MEASURE_EVERY_S = 0.02
DISK_WAIT_S = 5.0
STUCK_S = 0.2  # waited this long with no compaction running: evict, the deletes free too little
SLICE_BYTES = 256 << 20  # a manual compaction covers about this much of the store
MIB = 1 << 20
LARGE = 32 << 30
# Below this, RocksDB's own files and the disk reserve (2 MiB at least) are a large part
# of the capacity, and only the logical bound applies.
MIN_BOUNDED = 32 * MIB
BLOB_MIN = 256 << 10  # values this large go to blob files (a 110 KB value reads ~1.6x faster from the LSM)
log = logging.getLogger("cacheserver")


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


@dataclass(frozen=True)
class LsmSizes:
    write_buffer: int
    table_file: int
    level_base: int
    l0_trigger: int


def lsm_sizes(capacity: int) -> LsmSizes:
    """The LSM's sizes for a capacity (size_lsm); RocksDB's defaults from LARGE up."""
    small = capacity < LARGE
    return LsmSizes(write_buffer=_clamp(capacity // 128, 1 * MIB, 64 * MIB),
                    table_file=_clamp(capacity // 512, 1 * MIB, 64 * MIB),
                    level_base=_clamp(capacity // 64, 2 * MIB, 256 * MIB),
                    l0_trigger=2 if small else 4)


@functools.lru_cache(maxsize=16)  # asked at every put's admission, of one capacity per store
def headroom(capacity: int) -> int:
    """Bytes a running compaction may add before it deletes its inputs: HEADROOM of the
    capacity, or what one level-0 compaction writes when that is more. Ids are uniform
    hashes, so it rewrites the level-0 files and the whole base level (up to ~2x its target
    while it lags), plus one preallocated output file; RocksDB's sizes have floors (1-2 MiB),
    which made that 11% of a 48 MiB store, where 5% let `du` peak at 1.15x --capacity."""
    z = lsm_sizes(capacity)
    level0 = z.l0_trigger * z.write_buffer + 2 * z.level_base + z.table_file * 11 // 10
    return max(int(capacity * HEADROOM), level0)


def size_lsm(opts: rocksdict.Options, capacity: int) -> None:
    """RocksDB sizes scaled to the capacity, so that no compaction rewrites more than a
    few percent of the store (RocksDB's defaults from LARGE up). Ids are uniform hashes:
    every level-0 file spans the whole id space, and a file of the level above the
    last overlaps about `multiplier` times its size there."""
    z = lsm_sizes(capacity)
    small = capacity < LARGE
    opts.set_write_buffer_size(z.write_buffer)
    opts.set_target_file_size_base(z.table_file)
    # One compaction job writes at most about this much before its inputs go (RocksDB's
    # default is 25 table files): part of the transient that headroom() covers.
    opts.set_max_compaction_bytes(min(capacity // 32, 25 * z.table_file))
    opts.set_level_compaction_dynamic_level_bytes(True)
    multiplier = 4 if small else 10
    opts.set_max_bytes_for_level_multiplier(float(multiplier))
    opts.set_max_bytes_for_level_base(z.level_base)
    opts.set_level_zero_file_num_compaction_trigger(z.l0_trigger)
    # Unmerged level-0 files hold at most about capacity/16 before writes stop.
    stop = _clamp(capacity // 16 // z.write_buffer, 4, 36)
    stops_only(opts, stop, max(capacity // 4, 128 * MIB))


def stops_only(opts: rocksdict.Options, l0_stop: int = 36, pending_stop: int = 256 << 30) -> rocksdict.Options:
    """Writes stopped at these limits (RocksDB's defaults by default), never slowed down
    before them: a paced write waits inside RocksDB holding the GIL (rocksdict), and a stop
    that began meanwhile froze the whole server; stops are waited out in Python instead
    (stallwrite.py). Every column family: a stall in one holds up writes to all."""
    opts.set_level_zero_slowdown_writes_trigger(l0_stop)
    opts.set_level_zero_stop_writes_trigger(l0_stop)
    opts.set_soft_pending_compaction_bytes_limit(pending_stop)
    opts.set_hard_pending_compaction_bytes_limit(pending_stop)
    return opts


def large_values_options(capacity: int) -> rocksdict.Options:
    """The column family of values of BLOB_MIN bytes and up: in blob files, so that
    compactions move only their keys."""
    opts = rocksdict.Options(raw_mode=True)
    size_lsm(opts, capacity)
    opts.set_enable_blob_files(True)
    opts.set_min_blob_size(BLOB_MIN)
    # Files of 1/64 of the store (1-256 MiB): few files (a flush costs 40-75 ms here
    # whatever its size), few bytes pinned per survivor (diskadmit.py).
    opts.set_blob_file_size(_clamp(capacity // 64, 1 * MIB, 256 * MIB))
    # Memtables of 1/64 too: at the LSM's 1/128 a 1 MiB value filled one in a few puts.
    opts.set_write_buffer_size(_clamp(capacity // 64, 1 * MIB, 64 * MIB))
    return opts


@dataclass(frozen=True)
class OnDisk:
    tables: int  # RocksDB table and blob files (*.sst, *.blob): live values, dead values, tombstones
    other: int  # the log, MANIFEST, info logs, the disk reserve, ...
    blobs: int = 0  # of tables, the blob files

    @property
    def total(self) -> int:
        return self.tables + self.other


def room(capacity: int, disk: OnDisk, unflushed: int, used: int, reserved: int, need: int,
         stuck: bool = False) -> tuple[int, int]:
    """(bytes puts may add now, bytes to evict so that compacting the deletes frees
    enough for ``need``). ``used`` counts every entry, flushed or not; ``unflushed``
    the memtables (on disk after the next flush); ``reserved`` puts being written;
    ``stuck``: waiting has not helped, so what looked dead is not (evict all of it)."""
    budget = capacity - headroom(capacity)
    free = budget - disk.total - unflushed - reserved
    if need <= free:
        return free, 0
    dead = 0 if stuck else max(0, disk.tables + unflushed - int(used * (1 + TABLE_SLACK)))
    return max(0, free), max(0, need + int(capacity * SLACK) - free - dead)


def compactable(capacity: int, disk: OnDisk, unflushed: int, used: int, reserved: int, need: int) -> bool:
    """Whether compacting away every dead byte on disk (evicted values, tombstones: room()'s
    estimate) would leave room for ``need``: if not, and nothing more may be evicted, no wait will."""
    free = capacity - headroom(capacity) - disk.total - unflushed - reserved
    dead = max(0, disk.tables + unflushed - int(used * (1 + TABLE_SLACK)))
    return need <= free + dead


def bounded(capacity: int) -> bool:
    """Whether the bytes on disk are held within the capacity (see MIN_BOUNDED)."""
    return capacity >= MIN_BOUNDED


def hopeless(capacity: int, disk: OnDisk, need: int) -> bool:
    """No compaction can make room for ``need``: the files besides tables leave too little."""
    return need > capacity - headroom(capacity) - disk.other


class DiskUse:
    """The allocated bytes of a data dir, re-measured at most every MEASURE_EVERY_S."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._last = OnDisk(0, 0)

    def measure(self, fresh: bool = False) -> OnDisk:
        with self._lock:
            now = time.monotonic()
            if fresh or now - self._at >= MEASURE_EVERY_S:
                self._last, self._at = _scan(self.data_dir), now
            return self._last


def _scan(top: str) -> OnDisk:
    tables = other = blobs = 0
    stack = [top]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        continue
                    n = e.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:  # a compaction deleted it meanwhile
                    continue
                if e.name.endswith(".sst"):
                    tables += n
                elif e.name.endswith(".blob"):
                    tables += n
                    blobs += n
                else:
                    other += n
    return OnDisk(tables, other, blobs)


class Compactor:
    """Compacts one slice of the id space at a time in a background thread, so the
    tombstones of evicted values reach the files holding them (RocksDB compacts by
    itself only while writes come in, and puts are waiting for room)."""

    def __init__(self, db: rocksdict.Rdict, capacity: int) -> None:
        self._db = db
        self._busy = threading.Lock()
        self._next = 0
        self._slices = _clamp(capacity // SLICE_BYTES, 16, 4096)
        self._opts = rocksdict.CompactOptions()
        self._opts.set_exclusive_manual_compaction(False)
        self._stopped = False

    def stop(self, timeout: float = 60.0) -> None:
        """Start no more compactions and wait for the one running (the store closes next)."""
        self._stopped = True
        if self._busy.acquire(timeout=timeout):
            self._busy.release()

    def running(self) -> bool:
        return self._busy.locked() or bool(self._db.property_int_value("rocksdb.num-running-compactions"))

    def nudge(self, whole: bool = False) -> None:
        """Start a slice's compaction (``whole``: every id's, for an LSM of little more than
        keys) unless one, manual or RocksDB's own, is running."""
        if self._stopped or self.running():
            return
        if self._busy.acquire(blocking=False):
            threading.Thread(target=self._run, args=(whole,), daemon=True, name="store-compact").start()

    def _run(self, whole: bool) -> None:
        try:
            i, n = self._next, self._slices
            self._next = (i + 1) % n
            lo = None if whole else (i * 65536 // n).to_bytes(2, "big")
            hi = ((i + 1) * 65536 // n).to_bytes(2, "big") if i + 1 < n and not whole else None
            self._db.compact_range(lo, hi, self._opts)
        except Exception:  # RocksDB's errors are bare Exceptions; the next nudge retries
            log.exception("compacting the store for disk room failed")
        finally:
            self._busy.release()
