"""RocksDB-backed value store with strict capacity accounting.

Layout (column families of one RocksDB under DATA_DIR/db):
  default  id -> record.wrap(value) = value || xxh3_64(value): the trailer
           lets a read detect corruption without a second lookup.
  meta     id -> size, sequence, chunk, dataset: small, so a restart rebuilds
           the in-memory index and usage without reading values.
  server   server-wide state (server id, chunk table).
Durability (DURABILITY, --durability): with "process" or "power" a value and
its meta are written in one logged WriteBatch, so a kill -9 leaves either both
or neither. With "cache" (the default) the meta is logged first and the value
written without the log; flusher.py flushes soon after writes pause, and a
restart drops metas whose value was never flushed (_recover_unflushed), so a
kill -9 loses at most the last seconds of inserts, as misses. Anything that
fails its check on read is deleted, counted (`corrupt_dropped`) and answered
as a miss: corrupt bytes are never served.

Capacity: every entry is charged len(value) + OVERHEAD. Room is reserved under
a lock before a write starts, so used + reserved never exceeds capacity, also
with many concurrent writers.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import rocksdict

from .counters import Counters
from .diskbudget import DISK_WAIT_S, MEASURE_EVERY_S, STUCK_S, Compactor, DiskUse, bounded, hopeless, room, size_lsm
from .diskroom import MARGIN, DiskRoom
from .eviction import EvictionPolicy
from .flusher import Flusher
from .record import strip, unwrap, wrap
from .salvage import open_db

log = logging.getLogger("cacheserver")

# What a killed process may lose (--durability): "cache" the values of the last
# few seconds of inserts (flusher.py; they are misses afterwards, never wrong
# data), "process" nothing acknowledged, "power" nothing, even on power loss.
DURABILITY = ("cache", "process", "power")
DURABLE_MARK_KEY = b"durable_seq"  # in the "server" column family
OVERHEAD = 128  # key, meta, trailer and RocksDB per-entry cost, rounded up
EMPTY_MEMTABLE = 1 << 16  # what an empty memtable reports (its first arena block)
ROOM_FLUSH_WAIT_S = 60.0
FOLLOWER_FLUSH_MIN_BYTES = 4 << 20  # smaller logs replay in ~10 ms: not worth a flush
_META = struct.Struct("<QQi")  # size, sequence, chunk; dataset name follows
Tag = tuple[str, int]  # (dataset, chunk); ("", -1) is untagged
UNTAGGED: Tag = ("", -1)


def is_spare(tag: Tag) -> bool:
    """A dataset's item outside any chunk the manager gave space (chunk -1): it may
    only use room nobody else needs, so it is evicted first and evicts only its kind."""
    return tag[1] < 0 and tag[0] != ""


def tuned_for_reads(opts: rocksdict.Options) -> rocksdict.Options:
    # mmap'd SST reads skip one copy per value (measured 2.0 -> 2.8 GB/s alone).
    opts.set_allow_mmap_reads(True)
    return opts


def hot_read_options() -> rocksdict.ReadOptions:
    """Read options of the hit path (2.0 -> 5+ GB/s with mmap, measured in-process).

    Block checksums are skipped because every value carries its own xxh3
    trailer (record.py) that is checked on every read; the block cache is not
    filled because ~100 KB values only churn it, the OS page cache holds them."""
    ro = rocksdict.ReadOptions()
    ro.set_verify_checksums(False)
    ro.fill_cache(False)
    return ro


@dataclass
class TagUsage:
    items: int = 0
    bytes: int = 0


class DataDirBusy(RuntimeError):
    """Another store, in this process or another, has the data dir open."""


def _lock_dir(path: str) -> int:
    """Hold the data dir (flock on DIR/store.lock) for as long as the store is open."""
    fd = os.open(os.path.join(path, "store.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirBusy(f"data dir {path} is in use by another cache server") from None
    return fd


class Store:
    def __init__(self, path: str, capacity: int, policy: EvictionPolicy,
                 counters: Counters, *, durability: str = "cache", salvage: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        self.durability = durability
        os.makedirs(path, exist_ok=True)
        self.capacity = capacity
        self.policy = policy
        self.counters = counters
        self._lock = threading.Lock()
        self._room_flush = threading.Lock()  # held by the one flush that keeps unflushed bytes in check
        self._closing = False
        self._protected: Callable[[Tag], bool] = lambda tag: False

        self._dir_lock = _lock_dir(path)
        try:
            self._open(path, salvage)
        except BaseException:
            os.close(self._dir_lock)
            raise

    def _open(self, path: str, salvage: bool) -> None:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_paranoid_checks(True)
        opts.set_max_background_jobs(2)
        size_lsm(opts, self.capacity)  # bytes on disk within --capacity (diskbudget.py)
        # A memtable that fills up flushes every column family at once, so values
        # and their index entries reach the table files together.
        opts.set_atomic_flush(True)
        opts.set_keep_log_file_num(2)  # RocksDB's own info log: a few files of at most 1 MiB, not one per start
        opts.set_max_log_file_size(1 << 20)
        cf_opts = rocksdict.Options(raw_mode=True)
        self.db_path = os.path.abspath(os.path.join(path, "db"))
        self._db, repaired = open_db(self.db_path, tuned_for_reads(opts),
                                     {"meta": cf_opts, "server": cf_opts}, salvage)
        self._db.set_read_options(hot_read_options())
        self._meta = self._db.get_column_family("meta")
        self._server = self._db.get_column_family("server")
        self._meta_cf = self._db.get_column_family_handle("meta")
        # Index entries, deletes and server state always go through the log; values
        # skip it with durability "cache" (see DURABILITY and _recover_unflushed).
        self._wopts = rocksdict.WriteOptions()
        self._wopts.sync = self.durability == "power"
        self._vopts = self._wopts
        if self.durability == "cache":
            self._vopts = rocksdict.WriteOptions()
            self._vopts.disable_wal = True
        self._writing: set[int] = set()  # first sequence numbers of puts being written
        self._dirty_since: float | None = None  # oldest unflushed value (monotonic time)
        self._unflushed: dict[bytes, int] = {}  # id -> sequence of values only in the memtable
        self._last_write = 0.0
        self._last_unflushed_read = 0.0  # an unflushed value was served (flusher.py)

        # In-memory index: id -> (charge, tag index). Tags are interned.
        self._index: dict[bytes, tuple[int, int]] = {}
        self._tags: list[Tag] = [UNTAGGED]
        self._tag_ids: dict[Tag, int] = {UNTAGGED: 0}
        self._usage: dict[int, TagUsage] = {}
        self._spare: OrderedDict[bytes, None] = OrderedDict()  # spare entries, least recent first
        self._pending: set[bytes] = set()
        self.used = 0
        self._reserved = 0
        self._seq = 0
        self.room = DiskRoom(path, self.capacity)
        self.disk = DiskUse(path)
        self._disk_bounded = bounded(self.capacity)
        self._compactor = Compactor(self._db, self.capacity)
        self._recover(check_all=repaired)
        self._flusher = None
        if self.durability == "cache":
            self._set_durable_mark(self._seq)  # all recovered values are in table files now
            self._flusher = Flusher(self._dirty_state, self.flush)

    # ---- recovery -------------------------------------------------------
    def _recover(self, check_all: bool = False) -> None:
        entries = []
        for key, meta in self._meta.items():
            try:
                size, seq, chunk = _META.unpack_from(meta)
                dataset = bytes(meta[_META.size:]).decode()
            except (struct.error, UnicodeDecodeError):
                self._delete_keys([key])
                self.counters.add("corrupt_dropped")
                continue
            entries.append((seq, key, size, (dataset, chunk)))
        entries.sort()
        entries = self._recover_unflushed(entries, check_all)
        for seq, key, size, tag in entries:
            self._index_add(key, size + OVERHEAD, self._tag_id(tag))
            self.policy.admitted(key)
            self._seq = max(self._seq, seq + 1)
        self.counters.add("recovered_items", len(entries))
        if check_all:
            self._drop_orphans()
        if self.used > self.capacity:  # capacity lowered since last run
            self._evict_for(self.used - self.capacity)

    def _recover_unflushed(self, entries: list, check_all: bool = False) -> list:
        """Drop index entries whose value a killed process never flushed.

        With durability "cache" the index entry is logged before its value is
        written unlogged; a value is safe once a flush that started after it
        completed (the durable mark: every sequence number below it). Only the
        entries from the mark on are checked, a few seconds of inserts; all of
        them after a salvage (salvage.py), which may have dropped any value."""
        raw = self._server.get(DURABLE_MARK_KEY)
        if (raw is None and not check_all) or not entries:
            return entries
        mark = 0 if check_all else struct.unpack("<Q", raw)[0]
        lost = []
        for seq, key, _, _ in entries:
            if seq < mark:
                continue
            try:
                present = self._db.get(key) is not None
            except Exception:  # RocksDB reports corruption as an exception
                present = False
            if not present:
                lost.append(key)
        if not lost:
            return entries
        self._delete_keys(lost)
        self.counters.add("recovered_unflushed_dropped", len(lost))
        gone = set(lost)
        return [e for e in entries if e[1] not in gone]

    def _drop_orphans(self) -> None:
        """Delete values whose index entry a salvage lost: no one could evict them."""
        orphans = [k for k in self._db.keys() if k not in self._index]
        for k in orphans:
            self._db.delete(k, self._wopts)
        self.counters.add("salvage_orphans_dropped", len(orphans))

    def _set_durable_mark(self, seq: int) -> None:
        self._server.put(DURABLE_MARK_KEY, struct.pack("<Q", seq), self._wopts)

    # ---- index helpers (call with the lock held, or before serving) -----
    def _tag_id(self, tag: Tag) -> int:
        tid = self._tag_ids.get(tag)
        if tid is None:
            tid = self._tag_ids[tag] = len(self._tags)
            self._tags.append(tag)
        return tid

    def _index_add(self, key: bytes, charge: int, tid: int) -> None:
        self._index[key] = (charge, tid)
        if is_spare(self._tags[tid]):
            self._spare[key] = None
        u = self._usage.setdefault(tid, TagUsage())
        u.items += 1
        u.bytes += charge
        self.used += charge

    def _accessed(self, keys: Iterable[bytes]) -> None:
        """Hits, for the eviction order: the policy's, and the spare entries' own (lock held)."""
        accessed, spare = self.policy.accessed, self._spare
        for k in keys:
            accessed(k)
            if spare and k in spare:
                spare.move_to_end(k)

    def _index_remove(self, key: bytes) -> int:
        entry = self._index.pop(key, None)
        if entry is None:
            return 0
        charge, tid = entry
        u = self._usage[tid]
        u.items -= 1
        u.bytes -= charge
        if u.items == 0:
            del self._usage[tid]
        self.used -= charge
        self.policy.removed(key)
        if self._spare:
            self._spare.pop(key, None)
        self._unflushed.pop(key, None)
        return charge

    def _delete_keys(self, keys: Iterable[bytes]) -> None:
        wb = rocksdict.WriteBatch(raw_mode=True)
        for k in keys:
            wb.delete(k)
            wb.delete(k, self._meta_cf)
        self._db.write(wb, self._wopts)

    # ---- public API -----------------------------------------------------
    def set_protector(self, protected: Callable[[Tag], bool]) -> None:
        """Entries whose tag is protected (referenced chunks) are never fallback victims."""
        self._protected = protected

    @property
    def items(self) -> int:
        return len(self._index)

    def contains(self, keys: Sequence[bytes], not_spare: bool = False) -> bytes:
        """Presence flags; with not_spare, entries held only as spare count as absent
        (a client loading a chunk puts those again under the chunk, which retags them)."""
        index = self._index
        if not_spare and self._spare:
            spare = self._spare
            return bytes(1 if k in index and k not in spare else 0 for k in keys)
        return bytes(1 if k in index else 0 for k in keys)

    def adopt(self, keys: Sequence[bytes], tag: Tag) -> bytes:
        """Move entries held as spare into the chunk `tag` (no value travels: a job
        loading a chunk would otherwise get and put back bytes the server has).
        Presence flags after the move: 1 held other than as spare, 0 absent."""
        if tag[1] < 0 or not tag[0]:
            raise ValueError(f"adopt needs a chunk tag (dataset, chunk >= 0), got {tag!r}")
        with self._lock:
            index, spare = self._index, self._spare
            move = list(dict.fromkeys(k for k in keys if k in spare)) if spare else []
            if move:
                self._retag(move, tag, self._tag_id(tag), "adopted")
            return bytes(1 if k in index else 0 for k in keys)

    def touch(self, keys: Sequence[bytes]) -> bytes:
        """Presence flags, counted as accesses by the eviction policy."""
        return self.touch_split(keys)[0]

    def touch_split(self, keys: Sequence[bytes]) -> tuple[bytes, list[int]]:
        """touch(), and the positions of present values not flushed yet: a
        same-host follower cannot read those from the files (durability "cache")."""
        with self._lock:
            present = bytes(1 if k in self._index else 0 for k in keys)
            self._accessed([k for k, p in zip(keys, present) if p])
            unflushed = self._unflushed
            late = [i for i, k in enumerate(keys) if present[i] and k in unflushed] if unflushed else []
            if late:
                self._last_unflushed_read = time.monotonic()
        return present, late

    def get_many(self, keys: Sequence[bytes], trailer: bool = True) -> list[memoryview | None]:
        """Values (trailer stripped, zero-copy views) or None for misses. trailer=False
        skips the xxh3 check: only for a reader that authenticates every value itself."""
        out: list[memoryview | None] = []
        bad: list[bytes] = []
        get = self._db.get
        for k in keys:
            try:
                raw = get(k)
            except Exception:  # RocksDB reports corruption as an exception
                raw, bad_read = None, True
            else:
                bad_read = False
            if raw is None:
                if bad_read or k in self._index:  # meta without value: drop it
                    bad.append(k)
                out.append(None)
                continue
            value = unwrap(raw) if trailer else strip(raw)
            if value is None:
                bad.append(k)
            out.append(value)
        hits = [k for k, v in zip(keys, out) if v is not None]
        with self._lock:
            self._accessed(hits)
            for k in bad:
                self._index_remove(k)
        if bad:
            self._delete_keys(bad)
            self.counters.add("corrupt_dropped", len(bad))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], tag: Tag = UNTAGGED,
                 replace: bool = False, written_ids: list[bytes] | None = None) -> tuple[int, int, int]:
        """Store values not yet present (or overwrite, with replace: a client found the stored
        value poisoned). Returns (stored, already, rejected_full); adds the ids written to written_ids."""
        refused = self._room_for(items, tag, replace)
        if refused is not None:
            return refused
        already = 0
        todo: list[tuple[bytes, bytes | memoryview, int]] = []
        with self._lock:
            tid = self._tag_id(tag)
            seen: set[bytes] = set()
            if replace:
                for key, _ in items:
                    if key not in self._pending:
                        self._index_remove(key)  # the write below overwrites the record
            # a put under a chunk (not an untagged or spare one); dict.fromkeys: each id once
            retag = list(dict.fromkeys(k for k, _ in items if k in self._spare)) if tag[1] >= 0 and self._spare else []
            if retag:  # spare entries whose chunk now has room: they take the put's tag
                self._retag(retag, tag, tid)
            for key, value in items:
                if key in self._index or key in self._pending or key in seen:
                    already += 1
                    continue
                seen.add(key)
                todo.append((key, value, len(value) + OVERHEAD))
            accepted = self._within_room(todo, tag)
            rejected = len(todo) - len(accepted)
            reserve = sum(c for _, _, c in accepted)
            self._reserved += reserve
            self._pending.update(k for k, _, _ in accepted)
            seq0 = self._seq
            self._seq += len(accepted)
            if accepted:
                self._writing.add(seq0)
        written = False
        try:
            if accepted:
                self._write_values(accepted, seq0, tag)
            written = True
        except Exception as e:
            self.room.write_failed(e)
            raise
        finally:
            # One lock section: between leaving _pending and entering the index a
            # concurrent put of the same id would store it a second time.
            with self._lock:
                self._reserved -= reserve
                self._pending.difference_update(k for k, _, _ in accepted)
                self._writing.discard(seq0)
                if written:
                    for key, _, charge in accepted:
                        self._index_add(key, charge, tid)
                        self.policy.admitted(key)
        if written_ids is not None:
            written_ids.extend(k for k, _, _ in accepted)
        self.counters.add_many({"put_stored": len(accepted), "put_already": already,
                                "rejected_full": rejected,
                                "put_bytes": sum(len(v) for _, v, _ in accepted)})
        return len(accepted), already, rejected

    def _within_room(self, todo: list[tuple[bytes, bytes | memoryview, int]], tag: Tag) -> list:
        """The items (id, value, charge) that fit, evicting for them first (lock held)."""
        need = sum(c for _, _, c in todo)
        free = self.capacity - self.used - self._reserved
        if need > free:
            self._evict_for(need - free, spare_only=is_spare(tag))
            free = self.capacity - self.used - self._reserved
        if self._disk_bounded:  # what the files on disk leave (diskbudget.py); _make_disk_room waited for it
            free = min(free, room(self.capacity, self.disk.measure(), self._unflushed_bytes(), self.used,
                                  self._reserved, need)[0])
        accepted = []
        for key, value, charge in todo:
            if charge <= free:
                accepted.append((key, value, charge))
                free -= charge
        return accepted

    def _room_for(self, items: Sequence[tuple[bytes, bytes | memoryview]], tag: Tag,
                  replace: bool) -> tuple[int, int, int] | None:
        """put_many's answer when the file system has no room (_no_room); else None, once the
        files on disk leave room within the capacity for the ids not held yet (_make_disk_room)."""
        refused = self._no_room(items)
        if refused is None:
            index = self._index  # ids already held take no room (unless overwritten)
            need = sum(len(v) + OVERHEAD for k, v in items if replace or k not in index)
            if need:
                self._make_disk_room(need, is_spare(tag))
        return refused

    def _make_disk_room(self, need: int, spare_only: bool) -> None:
        """Wait, at most DISK_WAIT_S, until the files on disk leave room for ``need`` bytes
        (diskbudget.py), evicting where compacting the deletes would not free enough."""
        start = idle_since = time.monotonic()
        waited = False
        while self._disk_bounded and not self._closing:
            disk, now = self.disk.measure(), time.monotonic()
            if hopeless(self.capacity, disk, need):
                break
            if self._compactor.running():
                idle_since = now
            with self._lock:
                free, evict = room(self.capacity, disk, self._unflushed_bytes(), self.used, self._reserved, need,
                                   stuck=now - idle_since >= STUCK_S)
                if evict:
                    self._evict_for(evict, spare_only=spare_only)
                    idle_since = now
            if free >= need or now - start >= DISK_WAIT_S:
                break
            waited = True
            self._compactor.nudge()
            time.sleep(MEASURE_EVERY_S)
        if waited:
            self.counters.add("disk_waits")

    def _unflushed_bytes(self) -> int:
        return self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0

    def _no_room(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> tuple[int, int, int] | None:
        """put_many's answer when the file system has no room for the batch (diskroom.py)."""
        need = sum(len(v) + OVERHEAD for _, v in items)
        unflushed = self._unflushed_bytes()
        if self.room.put_problem(need, unflushed) is None:
            self._keep_flushable(need, unflushed)
            return None
        with self._lock:
            already = sum(1 for k, _ in items if k in self._index)
        self.counters.add_many({"rejected_disk_full": len(items) - already, "put_already": already})
        return 0, already, len(items) - already

    def _keep_flushable(self, need: int, unflushed: int) -> None:
        """Keep unflushed bytes within what the reserve can flush (diskroom.py) without
        stalling every writer: past half the reserve one flush starts in the background
        and puts go on; only a put that would pass the whole reserve waits for it (and
        flushes again if that was not enough). A flush in every put's thread made all
        writers queue behind it, each flushing in turn (puts at about 0.36x)."""
        reserve = self.room.reserve
        if unflushed + need <= reserve // 2 or self._closing:
            return
        if unflushed + need + MARGIN <= reserve:
            if self._room_flush.acquire(blocking=False):
                threading.Thread(target=self._flush_and_open, daemon=True, name="store-room-flush").start()
            return
        if not self._room_flush.acquire(timeout=ROOM_FLUSH_WAIT_S):  # closing, or a flush that hangs
            return
        try:
            now = self._unflushed_bytes()
            if now > EMPTY_MEMTABLE and now + need + MARGIN > reserve and not self._closing:
                self.flush()
        finally:
            self._room_flush.release()

    def _flush_and_open(self) -> None:
        try:
            self.flush()
        except Exception:  # flush() records write failures itself; keep the next put able to retry
            log.exception("flushing the store for disk room failed")
        finally:
            self._room_flush.release()

    def _retag(self, keys: list[bytes], tag: Tag, tid: int, counter: str = "put_retagged") -> None:
        """Move present entries to `tag` (lock held): index, usage and, logged, their
        index records (a fresh sequence: recovery keeps them only with their value)."""
        ds = tag[0].encode()
        mb = rocksdict.WriteBatch(raw_mode=True)
        for key in keys:
            charge, _ = self._index[key]
            unflushed = self._unflushed.get(key)
            self._index_remove(key)
            self._index_add(key, charge, tid)
            if unflushed is not None:  # the value itself is still only in the memtable
                self._unflushed[key] = unflushed
            self.policy.admitted(key)
            mb.put(key, _META.pack(charge - OVERHEAD, self._seq, tag[1]) + ds, self._meta_cf)
            self._seq += 1
        self._db.write(mb, self._wopts)
        self.counters.add(counter, len(keys))

    def _write_values(self, accepted: list, seq0: int, tag: Tag) -> None:
        ds = tag[0].encode()
        metas = [(key, _META.pack(len(value), seq0 + i, tag[1]) + ds) for i, (key, value, _) in enumerate(accepted)]
        if self._vopts is self._wopts:  # one logged batch: both or neither survive a crash
            wb = rocksdict.WriteBatch(raw_mode=True)
            for (key, value, _), (_, meta) in zip(accepted, metas):
                wb.put(key, wrap(value))
                wb.put(key, meta, self._meta_cf)
            self._db.write(wb, self._wopts)
            return
        # durability "cache": the index entry first, logged, so a crash leaves at most
        # an entry without its value, which _recover_unflushed finds; then the value
        # unlogged: the log is RocksDB's costliest part of a write (a CRC-32C of every
        # byte: about 2x the server CPU of an insert; tools/bench/misspath).
        mb = rocksdict.WriteBatch(raw_mode=True)
        for key, meta in metas:
            mb.put(key, meta, self._meta_cf)
        self._db.write(mb, self._wopts)
        vb = rocksdict.WriteBatch(raw_mode=True)
        for key, value, _ in accepted:
            vb.put(key, wrap(value))
        self._db.write(vb, self._vopts)
        now = time.monotonic()
        with self._lock:
            for i, (key, _, _) in enumerate(accepted):
                self._unflushed[key] = seq0 + i
            self._last_write = now
            if self._dirty_since is None:
                self._dirty_since = now

    def _dirty_state(self) -> tuple[float | None, float, float]:
        with self._lock:
            return self._dirty_since, self._last_write, self._last_unflushed_read

    def flush(self) -> None:
        """Write the memtables to table files; with durability "cache" this makes
        every value written before the call safe from a crash."""
        with self._lock:
            mark = min(self._writing) if self._writing else self._seq
            self._dirty_since = None  # a write from here on marks it again
        self.room.before_flush(self._unflushed_bytes())
        try:
            self._db.flush()
            self._meta.flush()
            self._server.flush()
        except Exception as e:  # RocksDB's errors are bare Exceptions; it stays read-only now
            self.room.write_failed(e)
            return
        if self.durability == "cache":
            self._set_durable_mark(mark)
            with self._lock:
                self._unflushed = {k: s for k, s in self._unflushed.items() if s >= mark}
        self.counters.add("flushes")

    def _evict_for(self, need: int, spare_only: bool = False) -> int:
        """Free at least `need` bytes (lock held): spare entries first, least recently
        used first, whatever the policy; then, unless spare_only, the fallback policy."""
        freed, victims, spare = 0, [], self._spare
        while spare and freed < need:
            key = next(iter(spare))
            freed += self._index_remove(key)  # drops it from spare too
            victims.append(key)
        n_spare = len(victims)
        if freed < need and not spare_only:
            protected = self._protected
            for key in self.policy.victims(lambda k: protected(self._tags[self._index[k][1]])
                                           if k in self._index else False):
                freed += self._index_remove(key)
                victims.append(key)
                if freed >= need:
                    break
        if victims:
            self._delete_keys(victims)
            self.counters.add_many({"evicted_spare": n_spare, "evicted_by_policy": len(victims) - n_spare,
                                    "evicted_items": len(victims), "evicted_bytes": freed})
        return freed

    def evict_tags(self, match: Callable[[Tag], bool]) -> tuple[int, int]:
        """Delete every entry whose tag matches (manager-directed eviction)."""
        with self._lock:
            tids = {tid for tid, tag in enumerate(self._tags) if match(tag)}
            keys = [k for k, (_, tid) in self._index.items() if tid in tids]
            freed = sum(self._index_remove(k) for k in keys)
        if keys:
            self._delete_keys(keys)
            self.counters.add_many({"evicted_items": len(keys), "evicted_bytes": freed})
        return len(keys), freed

    def usage_by_tag(self) -> dict[Tag, TagUsage]:
        with self._lock:
            return {self._tags[tid]: TagUsage(u.items, u.bytes) for tid, u in self._usage.items()}

    # ---- server-wide small state ---------------------------------------
    def flush_for_followers(self, min_bytes: int = FOLLOWER_FLUSH_MIN_BYTES) -> bool:
        """Flush the memtables (every column family, so the log can go) if they
        hold at least `min_bytes`. A follower that opens replays the live log
        (~3 ms/MB measured) and so does every other one; one flush (~2 ms/MB)
        makes each open ~5 ms instead. Returns whether it flushed."""
        if self._db.property_int_value("rocksdb.cur-size-all-mem-tables") < min_bytes:
            return False
        self.flush()
        return True

    def get_state(self, key: str) -> bytes | None:
        return self._server.get(key.encode())

    def put_state(self, key: str, value: bytes) -> None:
        self._server.put(key.encode(), value, self._wopts)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.stop()
        self._closing = True
        self._compactor.stop()
        self._room_flush.acquire()  # kept: a background flush (_keep_flushable) ends first, none starts later
        self.flush()
        try:
            # Column-family views share the DB handle; drop them so the lock is released.
            self._meta.close()
            self._server.close()
            del self._meta, self._server, self._meta_cf
            self._db.close()
        except Exception as e:  # a store that failed a write fails its close the same way
            if self.room.state != "failed":
                raise
            log.error("closing the store after a failed write: %s; items not yet flushed are refetched "
                      "as misses after restart", " ".join(str(e).split()))
        os.close(self._dir_lock)
