"""Admission of a store's puts by room on disk (the Store's side of diskroom.py and diskbudget.py).

Two limits apply before a put is written, apart from --capacity's logical bytes:

* the file system's free space (diskroom.py): a put that it cannot take, with
  everything not flushed yet, is refused (``rejected_disk_full``), and unflushed
  bytes are kept within what the disk reserve can flush;
* the bytes on disk within --capacity (diskbudget.py): a put waits, at most
  DISK_WAIT_S, until the files leave room for it, evicting where compacting the
  deletes would not free enough, or, where evicted values sit in blob files that
  long-lived values pin, rewriting the oldest of those (Store.relocate_oldest).

And while RocksDB keeps writes stopped after a write gave up on the stop
(stallwrite.py: its compactions fail, as they do without the disk room they
need), puts are refused at once, also as ``rejected_disk_full``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .diskbudget import (DISK_WAIT_S, MEASURE_EVERY_S, STUCK_S, TABLE_SLACK, Compactor, DiskUse, OnDisk, bounded,
                         compactable, hopeless, room)
from .diskroom import MARGIN, DiskRoom

log = logging.getLogger("cacheserver")
EMPTY_MEMTABLE = 1 << 16  # what an empty memtable reports (its first arena block)
ROOM_FLUSH_WAIT_S = 60.0
PINNED = 0.05  # of capacity: dead bytes in blob files worth rewriting their survivors for
RELOCATE = 0.02  # of capacity: survivors rewritten at most per step (held on disk twice until compacted)...
RELOCATE_MAX = 64 << 20  # ...and at most this (it holds the store's lock)
Items = Sequence[tuple[bytes, "bytes | memoryview"]]


class AdmittedStore(Protocol):
    """What admission needs of its store (store.py)."""
    capacity: int
    used: int
    reserved: int
    closing: bool
    blob_bytes: int
    overhead: int
    counters: Any
    lock: threading.Lock
    db_handle: Any
    progress: Any  # stallwrite.Progress

    def value_families(self) -> tuple: ...

    def evict_for(self, need: int, spare_only: bool = False) -> int: ...

    def relocate_oldest(self, max_bytes: int) -> int: ...

    def held(self, keys: Iterable[bytes]) -> int: ...

    def flush(self) -> bool: ...


class DiskAdmission:
    def __init__(self, store: AdmittedStore, data_dir: str) -> None:
        self.store = store
        self.capacity = store.capacity
        self.room = DiskRoom(data_dir, store.capacity)
        self.disk = DiskUse(data_dir)
        self.bounded = bounded(store.capacity)
        self.compactor = Compactor(store.db_handle, store.capacity)
        self._room_flush = threading.Lock()  # held by the one flush that keeps unflushed bytes in check

    def unflushed(self) -> int:
        prop = "rocksdb.cur-size-all-mem-tables"  # per column family: the values' two
        return sum(cf.property_int_value(prop) or 0 for cf in self.store.value_families())

    def refused(self, items: Items, need_new: int, spare_only: bool) -> tuple[int, int, int] | None:
        """put_many's answer when the file system has no room (refused_disk_full); else None, once
        the files on disk leave room within the capacity for ``need_new`` bytes (make_room)."""
        refused = self.refused_disk_full(items, need_new)
        if refused is None and need_new:
            self.make_room(need_new, spare_only)
        return refused

    def free(self, need: int) -> int:
        """What the files on disk leave for puts now (store lock held)."""
        s = self.store
        return room(self.capacity, self.disk.measure(), self.unflushed(), s.used, s.reserved, need)[0]

    def make_room(self, need: int, spare_only: bool) -> None:
        """Wait, at most DISK_WAIT_S, until the files on disk leave room for ``need`` bytes
        (diskbudget.py), evicting where compacting the deletes would not free enough."""
        s = self.store
        start = idle_since = time.monotonic()
        waited = False
        while self.bounded and not s.closing:
            disk, now = self.disk.measure(), time.monotonic()
            if hopeless(self.capacity, disk, need):
                break
            if self.compactor.running():
                idle_since = now
            stuck = now - idle_since >= STUCK_S
            if stuck and self._relocate_pinned(disk):
                idle_since = now
                stuck = False
            with s.lock:
                free, evict = room(self.capacity, disk, self.unflushed(), s.used, s.reserved, need, stuck=stuck)
                futile = False
                if evict:
                    idle_since = now
                    # nothing more this put may evict (--eviction none, referenced chunks, a spare put), and
                    # compacting the dead bytes would not free enough: no wait helps (it took DISK_WAIT_S)
                    if s.evict_for(evict, spare_only=spare_only) < evict:
                        futile = not compactable(self.capacity, disk, self.unflushed(), s.used, s.reserved, need)
            if free >= need or futile or now - start >= DISK_WAIT_S:
                break
            waited = True
            self.compactor.nudge(whole=self._lsm_small(disk))
            time.sleep(MEASURE_EVERY_S)
        if waited:
            s.counters.add("disk_waits")

    def _lsm_small(self, disk: OnDisk) -> bool:
        """The table files hold little but keys: one compaction of every id is cheap."""
        return disk.tables - disk.blobs < self.capacity // 16

    def _relocate_pinned(self, disk: OnDisk) -> bool:
        """Rewrite the oldest values that pin blob files full of evicted ones (see
        diskbudget.py); returns whether it did (then compactions free the files)."""
        s = self.store
        pinned = disk.blobs - int(s.blob_bytes * (1 + TABLE_SLACK))
        if pinned < self.capacity * PINNED:
            return False
        moved = s.relocate_oldest(min(RELOCATE_MAX, int(self.capacity * RELOCATE)))
        if moved:
            self.compactor.nudge(whole=self._lsm_small(disk))
        return moved > 0

    def refused_disk_full(self, items: Items, need: int) -> tuple[int, int, int] | None:
        """put_many's answer when the file system has no room for the batch's ``need`` bytes not
        held yet (diskroom.py; ids held are not written again), or RocksDB's writes stay stopped
        (stallwrite.Progress.refusing)."""
        unflushed = self.unflushed()
        if self.room.put_problem(need, unflushed) is None and self.store.progress.refusing() is None:
            self._keep_flushable(need, unflushed)
            return None
        already = self.store.held(k for k, _ in items)
        self.store.counters.add_many({"rejected_disk_full": len(items) - already, "put_already": already})
        return 0, already, len(items) - already

    def _keep_flushable(self, need: int, unflushed: int) -> None:
        """Keep unflushed bytes within what the reserve can flush (diskroom.py) without
        stalling every writer: past half the reserve one flush starts in the background
        and puts go on; only a put that would pass the whole reserve waits for it (and
        flushes again if that was not enough). A flush in every put's thread made all
        writers queue behind it, each flushing in turn (puts at about 0.36x)."""
        reserve, s = self.room.reserve, self.store
        if unflushed + need <= reserve // 2 or s.closing:
            return
        if unflushed + need + MARGIN <= reserve:
            if self._room_flush.acquire(blocking=False):
                threading.Thread(target=self._flush_and_open, daemon=True, name="store-room-flush").start()
            return
        if not self._room_flush.acquire(timeout=ROOM_FLUSH_WAIT_S):  # closing, or a flush that hangs
            return
        try:
            now = self.unflushed()
            if now > EMPTY_MEMTABLE and now + need + MARGIN > reserve and not s.closing:
                s.flush()
        finally:
            self._room_flush.release()

    def _flush_and_open(self) -> None:
        try:
            self.store.flush()
        except Exception:  # flush() records write failures itself; keep the next put able to retry
            log.exception("flushing the store for disk room failed")
        finally:
            self._room_flush.release()

    def stop(self) -> None:
        """No more compactions or background flushes (the store closes next); the lock is kept."""
        self.compactor.stop()
        self._room_flush.acquire()
