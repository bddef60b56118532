"""RocksDB-backed value store with strict capacity accounting.

Layout (column families of one RocksDB under DATA_DIR/db):
  default  id -> record.wrap(value) = value || xxh3_64(value): the trailer
           lets a read detect corruption without a second lookup. In a plain
           dir (datadir.py: an embedded cache's own) the value alone, checked
           by RocksDB's block checksums on every read instead (plain_read_options).
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

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import rocksdict

from .counters import Counters
from .datadir import DataDirBusy, PlaintextDir, claim_records, lock_dir, make_dir
from .diskadmit import DiskAdmission
from .diskbudget import BLOB_MIN, large_values_options, size_lsm, stops_only
from .eviction import EvictionPolicy
from .flusher import Flusher
from .hitlog import HitLog
from .owedeletes import OwedDeletes
from .record import wrap
from .rocksopts import filtered, hot_read_options, plain_read_options, tuned_for_reads
from .salvage import open_db
from .stallwrite import Progress, puts
from .storeevict import Evictions
from .storeflush import Flushes, GatedWrites, WriteGate, rocksdb_error
from .storereads import Reads
from .storerecovery import _META, Recovery
from .tagtable import UNTAGGED, Tag, TagTable, TagUsage, is_spare

log = logging.getLogger("cacheserver")

# What a killed process may lose (--durability): "cache" the values of the last
# few seconds of inserts (flusher.py; they are misses afterwards, never wrong
# data), "process" nothing acknowledged, "power" nothing, even on power loss.
DURABILITY = ("cache", "process", "power")
OVERHEAD = 128  # key, meta, trailer and RocksDB per-entry cost, rounded up
Replaced = tuple[int, Tag, int | None]  # a replaced entry: charge, tag, unflushed sequence (Store._unindex)
__all__ = ["DURABILITY", "OVERHEAD", "UNTAGGED", "DataDirBusy", "PlaintextDir", "Store", "Tag", "TagUsage", "hot_read_options",
           "is_spare", "tuned_for_reads"]


class Store(Recovery, Flushes, Reads, Evictions):
    def __init__(self, path: str, capacity: int, policy: EvictionPolicy,
                 counters: Counters, *, durability: str = "cache", salvage: bool = False,
                 plain: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        self.durability = durability
        make_dir(path)
        self.capacity = capacity
        self.policy = policy
        self.counters = counters
        self._lock = threading.Lock()
        self.overhead = OVERHEAD
        self._gate = WriteGate()  # what close waits for: flushes and writes under way (storeflush.py)
        self._protected: Callable[[Tag], bool] = lambda tag: False
        self._owed = OwedDeletes(path, sync=durability == "power")  # stranded deletes, for a restart

        self._dir_lock = lock_dir(path)
        try:
            claim_records(path, plain)  # a plain dir only as plain, a sealed one only as sealed
            self.plain = plain
            self._open(path, salvage)
        except BaseException:
            self._close_half_open()
            os.close(self._dir_lock)
            raise

    def _close_half_open(self) -> None:
        """Close what a failed _open opened: RocksDB left open keeps its LOCK in this process,
        and a retry here (the embedded cache's) was refused as a damaged store."""
        if "admit" in self.__dict__:
            self.admit.stop()
        self._release_db()  # its errors: the open's own is the one raised
        for name in ("_db", "progress", "_logged", "_unlogged"):
            self.__dict__.pop(name, None)

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
        cf_opts = stops_only(filtered(rocksdict.Options(raw_mode=True)))  # RocksDB's limits, no pacing
        self.db_path = os.path.abspath(os.path.join(path, "db"))
        cfs = {"meta": cf_opts, "server": cf_opts, "large": filtered(large_values_options(self.capacity))}
        self._db, repaired = open_db(self.db_path, tuned_for_reads(opts), cfs, salvage)
        self._db.set_read_options(plain_read_options() if self.plain else hot_read_options())
        self._meta = self._db.get_column_family("meta")
        self._server = self._db.get_column_family("server")
        self._meta_cf = self._db.get_column_family_handle("meta")
        self._server_cf = self._db.get_column_family_handle("server")
        # Values of BLOB_MIN bytes and up, in blob files (diskbudget.py); same-host followers
        # do not open this family (a RocksDB secondary crashes reading a blob) and ask the server.
        self._large = self._db.get_column_family("large")
        self._large_cf = self._db.get_column_family_handle("large")
        self._writers()
        self._writing: set[int] = set()  # first sequence numbers of puts being written
        # id -> sequence of a put or delete a write stop ended (put_many, _delete_keys, _delete_soon,
        # a start's deletes): records on disk the index does not account for (an index record
        # without its value, a value no longer indexed); deleted once writes go again
        # (Flushes._drop_stranded), holding the durable mark, or by the logged batch of a put of
        # the id (_write_index), which so leaves no old copy in the other size class
        self._stranded: dict[bytes, int] = {}
        self._dirty_since: float | None = None  # oldest unflushed value (monotonic time)
        self._unflushed: dict[bytes, int] = {}  # id -> sequence of values only in the memtable
        self._last_write = 0.0
        self._last_unflushed_read = 0.0  # an unflushed value was served (flusher.py)

        # In-memory index: id -> (charge, tag id); the tags of the entries held (tagtable.py).
        self._index: dict[bytes, tuple[int, int]] = {}
        self._tags = TagTable()
        self._hits = HitLog(self._accessed, self._lock)  # gets' hits, applied under the lock
        self._spare: OrderedDict[bytes, None] = OrderedDict()  # spare entries, least recent first
        self._aged: OrderedDict[bytes, int] = OrderedDict()  # values in blob files, oldest write first
        self.blob_bytes = 0  # their charges
        self._pending: set[bytes] = set()
        self.used = 0
        self._reserved = 0
        self._seq = 0
        # Flushes and replaces, counted: a follower's view from before one may hold an older value of an
        # id than the store (storeflush.py). Random start: another instance's is never taken for this one's.
        self.generation = int.from_bytes(os.urandom(6), "little")
        self.admit = DiskAdmission(self, path)
        self.room = self.admit.room
        self._recover(check_all=repaired)
        self._flusher = None
        if self.durability == "cache":
            self._owe_mark()  # all recovered values are in table files now
            self._flusher = Flusher(self._dirty_state, self.flush)

    def _writers(self) -> None:
        # Index entries, deletes and server state always go through the log; values
        # skip it with durability "cache" (see DURABILITY and _recover_unflushed).
        self._wopts = rocksdict.WriteOptions()
        self._wopts.sync = self.durability == "power"
        self._vopts = self._wopts
        if self.durability == "cache":
            self._vopts = rocksdict.WriteOptions()
            self._vopts.disable_wal = True
        # Every write waits out a RocksDB write stop outside RocksDB, or gives up on one that
        # nothing ends (stallwrite.py); a close gives up on them before it releases RocksDB (storeflush.py).
        self.progress = Progress(self._db)
        self._logged = GatedWrites(self._db, self._wopts, self.progress, self._gate)
        self._unlogged = (self._logged if self._vopts is self._wopts
                          else GatedWrites(self._db, self._vopts, self.progress, self._gate))

    # ---- index helpers (call with the lock held, or before serving) -----
    def _index_add(self, key: bytes, charge: int, tid: int) -> None:
        # the index entry last: readers without the lock (get_many, touch_split) that see it
        # must find a large value in _aged, or they look in the wrong family
        if is_spare(self._tags[tid]):
            self._spare[key] = None
        if charge >= BLOB_MIN + OVERHEAD and key not in self._aged:
            self._aged[key] = charge
            self.blob_bytes += charge
        self._index[key] = (charge, tid)
        self._tags.add(tid, charge)
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
        self._tags.remove(tid, charge)  # the tag goes with its last entry
        self.used -= charge
        self.policy.removed(key)
        if self._spare:
            self._spare.pop(key, None)
        self._unflushed.pop(key, None)
        if self._aged.pop(key, None) is not None:
            self.blob_bytes -= charge
        return charge

    def _delete_keys(self, keys: Iterable[bytes], large: Iterable[bytes] | None = None) -> None:
        """Delete values and index records; from the large values' family only ``large`` (None:
        every key): a tombstone there costs a table file at the next flush."""
        keys = list(keys)
        large = keys if large is None else list(large)
        try:
            self._logged(lambda: self._delete_batch(keys, large))
        except Exception as e:  # their ids left the index (evicted, dropped): deleted once writes go again
            for k in keys:
                self._stranded.setdefault(k, self._seq)
            self._owed.record((k, self._stranded[k]) for k in keys)  # and by a restart before that
            self._put_failed(e)  # RocksDB's own error fails the store, as a put's does
            raise

    def _delete_soon(self, keys: list[bytes], large: list[bytes] | None = None, raising: bool = False) -> None:
        """Delete the records of ``keys`` (out of the index; lock held; from the large values' family
        only ``large``, None: every key) without waiting out a write stop, for a get or the manager's
        eviction: one try, and what it could not delete is stranded, deleted by the first flush once
        writes go again (Flushes._drop_stranded; the flusher is asked for one: _retry_soon) or at a
        restart found again, and indexed and counted, or dropped (a corrupt record). ``raising``:
        RocksDB's own error is raised too, once its ids are stranded."""
        error = None
        try:
            if self._logged.once(lambda: self._delete_batch(keys, keys if large is None else large)):
                return
        except Exception as e:  # a closing store's, or RocksDB's own: that fails the store, as a put's does
            self._put_failed(e)
            error = e if raising and rocksdb_error(e) else None
        for k in keys:
            self._stranded.setdefault(k, self._seq)
        self._owed.record((k, self._stranded[k]) for k in keys)  # a restart before that deletes them too
        self._retry_soon()
        if error is not None:
            raise error

    def _delete_batch(self, keys: list[bytes], large: list[bytes]) -> rocksdict.WriteBatch:
        wb = rocksdict.WriteBatch(raw_mode=True)
        for k in keys:
            wb.delete(k)
            wb.delete(k, self._meta_cf)
        for k in large:
            wb.delete(k, self._large_cf)
        return wb

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
        Flags after the move: 1 held other than as spare, 0 absent or still spare (a stop refused it)."""
        if tag[1] < 0 or not tag[0]:
            raise ValueError(f"adopt needs a chunk tag (dataset, chunk >= 0), got {tag!r}")
        with self._lock:
            index, spare = self._index, self._spare
            move = list(dict.fromkeys(k for k in keys if k in spare)) if spare else []
            if move:
                tid = self._tags.pin(tag)
                try:
                    self._retag(move, tag, tid, "adopted")
                except BaseException as e:  # nothing moved (_retag writes first); a RocksDB error fails the store
                    self._put_failed(e)
                    raise
                finally:
                    self._tags.unpin(tid)
            return bytes(1 if k in index and k not in spare else 0 for k in keys)

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], tag: Tag = UNTAGGED,
                 replace: bool = False, written_ids: list[bytes] | None = None) -> tuple[int, int, int]:
        """Store values not yet present (or overwrite, with replace: a client found the stored
        value poisoned). Returns (stored, already, rejected_full); adds the ids written to written_ids."""
        refused = self.admit.refused(items, self._new_bytes(items, replace), is_spare(tag))
        if refused is not None:
            return refused
        with self._lock:
            tid = self._tags.pin(tag)  # until the values are indexed: the tag may lose its last entry meanwhile
            try:
                accepted, already, rejected, replaced = self._accept(items, tag, tid, replace)
            except BaseException as e:
                self._tags.unpin(tid)
                self._put_failed(e)
                raise
            reserve = sum(c for _, _, c in accepted)
            self._reserved += reserve
            self._pending.update(k for k, _, _ in accepted)
            seq0 = self._seq
            self._seq += len(accepted)
            if accepted:
                self._writing.add(seq0)
            stale = {k for k, _, _ in accepted if k in self._stranded} if self._stranded else set()
        written = logged = False
        try:
            if accepted:
                self._write_index(accepted, seq0, tag, replaced, stale)
                logged = True
                self._write_unlogged(accepted, seq0)
            written = True
        except BaseException as e:
            self._put_failed(e)
            raise
        finally:
            # One lock section: between leaving _pending and entering the index a
            # concurrent put of the same id would store it a second time.
            with self._lock:
                self._reserved -= reserve
                self._pending.difference_update(k for k, _, _ in accepted)
                self._writing.discard(seq0)
                if written:
                    self.generation += bool(replaced)  # before indexing: older follower views hold old values
                    for key, _, charge in accepted:
                        self._index_add(key, charge, tid)
                        self.policy.admitted(key)
                    for key in stale:  # the put's logged batch deleted what the stop left of them
                        self._stranded.pop(key, None)
                elif logged:  # its index records are in, maybe not its values; replaced values are deleted
                    self._stranded.update((key, seq0 + i) for i, (key, _, _) in enumerate(accepted))
                else:  # nothing of it reached the disk: what it would have replaced is held as before
                    self._restore(replaced)
                self._tags.unpin(tid)
        if accepted and self._stranded:  # its write went in, so writes go: deletes a stop left, one try
            self._drop_stranded()  # (the flusher's, and the only retry without one: durability "process")
        if written_ids is not None:
            written_ids.extend(k for k, _, _ in accepted)
        self.counters.add_many({"put_stored": len(accepted), "put_already": already,
                                "rejected_full": rejected,
                                "put_bytes": sum(len(v) for _, v, _ in accepted)})
        return len(accepted), already, rejected

    def _accept(self, items: Sequence[tuple[bytes, bytes | memoryview]], tag: Tag, tid: int,
                replace: bool) -> tuple[list, int, int, dict[bytes, Replaced]]:
        """(accepted (id, value, charge), already, rejected, replaced) of a put (lock held): replaced
        ids leave the index, spare ones put under a chunk take its tag, room is made by evicting."""
        replaced = self._unindex(items) if replace else {}  # the write overwrites their records
        try:
            # a put under a chunk (not an untagged or spare one); dict.fromkeys: each id once
            retag = list(dict.fromkeys(k for k, _ in items if k in self._spare)) if tag[1] >= 0 and self._spare else []
            if retag:  # spare entries whose chunk now has room: they take the put's tag (kept spare in a stop)
                self._retag(retag, tag, tid)
            todo, already = self._new_items(items)
            accepted = self._within_room(todo, tag)
            if replaced:
                self._drop_replaced(replaced, accepted)
        except BaseException:  # an eviction's delete stopped (stallwrite.py), or any other failure
            self._restore(replaced)  # their records are untouched: held, and counted, as before
            raise
        return accepted, already, len(todo) - len(accepted), replaced

    def _unindex(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> dict[bytes, Replaced]:
        """Drop held ids (not ones being written) from the index for a replace (lock held):
        id -> (charge, tag, unflushed sequence or None) of the record the new value replaces."""
        out: dict[bytes, Replaced] = {}
        for key, _ in items:
            entry = self._index.get(key)
            if entry is not None and key not in self._pending:
                out[key] = (entry[0], self._tags[entry[1]], self._unflushed.get(key))
                self._index_remove(key)
        return out

    def _restore(self, replaced: dict[bytes, Replaced]) -> None:
        """Index again the records a failed replace did not touch (lock held): on disk all along,
        they were neither counted nor evictable until a restart, which served them again."""
        for key, (charge, tag, unflushed) in replaced.items():
            self._stranded.pop(key, None)  # a failed delete of _drop_replaced left them as they were
            tid = self._tags.pin(tag)
            if unflushed is not None:  # before the index entry, as put_many does
                self._unflushed[key] = unflushed
            self._index_add(key, charge, tid)
            self.policy.admitted(key)
            self._tags.unpin(tid)

    def _put_failed(self, err: BaseException) -> None:
        """Only a RocksDB error fails the store (RocksDB refuses writes after one until it is
        reopened); anything else (out of memory, a bad value) fails this put alone."""
        if rocksdb_error(err):
            self.room.write_failed(err)

    def _new_items(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> tuple[list, int]:
        """(id, value, charge) of each id neither held nor being written, once; and how
        many of the items were (lock held)."""
        todo, seen, already = [], set(), 0
        for key, value in items:
            if key in self._index or key in self._pending or key in seen:
                already += 1
                continue
            seen.add(key)
            todo.append((key, value, len(value) + OVERHEAD))
        return todo, already

    def _new_bytes(self, items: Sequence[tuple[bytes, bytes | memoryview]], replace: bool) -> int:
        index = self._index  # ids already held take no room (unless overwritten)
        return sum(len(v) + OVERHEAD for k, v in items if replace or k not in index)

    def _within_room(self, todo: list[tuple[bytes, bytes | memoryview, int]], tag: Tag) -> list:
        """The items (id, value, charge) that fit, evicting for them first (lock held); one
        larger than the whole capacity is refused without evicting anything for it."""
        todo = [t for t in todo if t[2] <= self.capacity]
        need = sum(c for _, _, c in todo)
        free = self.capacity - self.used - self._reserved
        if need > free:
            self.evict_for(need - free, spare_only=is_spare(tag))
            free = self.capacity - self.used - self._reserved
        if self.admit.bounded:  # what the files on disk leave (diskbudget.py); admit.make_room waited for it
            free = min(free, self.admit.free(need))
        accepted = []
        for key, value, charge in todo:
            if charge <= free:
                accepted.append((key, value, charge))
                free -= charge
        return accepted

    # ---- for the disk admission (diskadmit.py) --------------------------
    @property
    def db_handle(self) -> rocksdict.Rdict:
        return self._db

    def value_families(self) -> tuple:
        return self._db, self._large

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def reserved(self) -> int:
        return self._reserved

    def held(self, keys: Iterable[bytes]) -> int:
        with self._lock:
            return sum(1 for k in keys if k in self._index)

    def _unflushed_bytes(self) -> int:
        return self.admit.unflushed()

    def _retag(self, keys: list[bytes], tag: Tag, tid: int, counter: str = "put_retagged") -> bool:
        """Move present entries to `tag` (lock held, `tid` pinned): their index records first, logged
        (a fresh sequence: recovery keeps them only with their value), then index, usage and order,
        so that a write that stops or fails leaves both as they were. Each index entry changes in
        one step: readers without the lock (get_many, touch_split) never miss it. One try (a stop's
        wait held every put and adopt): a stop moves nothing and counts them `retag_stopped` (returns False)."""
        ds, seq0 = tag[0].encode(), self._seq
        metas = [(key, _META.pack(self._index[key][0] - OVERHEAD, seq0 + i, tag[1]) + ds)
                 for i, key in enumerate(keys)]
        if not self._logged.once(lambda: puts(metas, self._meta_cf)):
            self.counters.add("retag_stopped", len(keys))  # left spare: a put counts them put_already
            return False
        self._seq += len(keys)
        spare = is_spare(tag)
        for key in keys:
            charge, old = self._index[key]
            self._index[key] = (charge, tid)
            self._tags.add(tid, charge)
            self._tags.remove(old, charge)  # the old tag goes with its last entry
            if spare:
                self._spare[key] = None
            elif self._spare:
                self._spare.pop(key, None)
            self.policy.removed(key)  # the most recent entry of the policy now, as a new one
            self.policy.admitted(key)
        self.counters.add(counter, len(keys))
        return True

    def _drop_replaced(self, replaced: dict[bytes, Replaced], accepted: list) -> None:
        """Delete the records of replaced ids that found no room (lock held): poisoned, and
        no longer indexed, they would lie on disk unaccounted until a restart. They leave
        ``replaced``: a failed write of the put has nothing of theirs to restore."""
        kept = {k for k, _, _ in accepted}
        dropped = [k for k in replaced if k not in kept]
        if dropped:  # one try: the lock is held (a stop strands them, deleted once writes go)
            self._delete_soon(dropped, [k for k in dropped if replaced[k][0] >= BLOB_MIN + OVERHEAD], raising=True)
            for k in dropped:
                del replaced[k]

    def _write_index(self, accepted: list, seq0: int, tag: Tag, replaced: dict[bytes, Replaced],
                     stale: set[bytes]) -> None:
        """Write the index records of accepted (id, value, charge) items, logged, with their values
        where those are logged too; a replaced record, or any record of a ``stale`` (stranded) id, is
        deleted in this batch where the new value does not overwrite it: left for a flush, a close or
        a kill before it kept an old copy in the other family for good, counted by no one. Durability
        "cache": the index records first, so a crash leaves at
        most an entry without its value, which _recover_unflushed finds; the values then go
        unlogged (_write_unlogged): the log is RocksDB's costliest part of a write (a CRC-32C of
        every byte: about 2x the server CPU of an insert; tools/bench/misspath)."""
        ds, both = tag[0].encode(), self._unlogged is self._logged  # both: one logged batch, both or neither survive

        def batch() -> rocksdict.WriteBatch:
            wb = rocksdict.WriteBatch(raw_mode=True)
            for i, (key, value, _) in enumerate(accepted):
                if key in stale:
                    self._delete_stale(wb, key, value, both)
                self._delete_other(wb, key, value, replaced, both)
                if both:
                    self._put_value(wb, key, value)
                wb.put(key, _META.pack(len(value), seq0 + i, tag[1]) + ds, self._meta_cf)
            return wb
        if self._mark_owed is not None or self._state_owed:  # what a stop kept off the disk at start
            self._pay_owed()  # a mark before the records it must cover
        self._logged(batch)

    def _write_unlogged(self, accepted: list, seq0: int) -> None:
        """The values of _write_index's records, where they skip the log (durability "cache")."""
        if self._unlogged is self._logged:
            return

        def batch() -> rocksdict.WriteBatch:
            wb = rocksdict.WriteBatch(raw_mode=True)
            for key, value, _ in accepted:
                self._put_value(wb, key, value)
            return wb
        self._unlogged(batch)
        now = time.monotonic()
        with self._lock:
            for i, (key, _, _) in enumerate(accepted):
                self._unflushed[key] = seq0 + i
            self._last_write = now
            if self._dirty_since is None:
                self._dirty_since = now

    def _delete_other(self, wb: rocksdict.WriteBatch, key: bytes, value: bytes | memoryview,
                      replaced: dict[bytes, Replaced], both: bool) -> None:
        """A replaced record, deleted unless this batch overwrites it: in the other family (a large
        one would stay in the blob files, counted, while the id is held), and in its own where the
        new value goes unlogged: a kill before its flush brought the poisoned one back."""
        old = replaced[key][0] if replaced and key in replaced else None
        if old is None:
            return
        was_large, large = old >= BLOB_MIN + OVERHEAD, len(value) >= BLOB_MIN
        if was_large and (not large or not both):
            wb.delete(key, self._large_cf)
        elif not was_large and (large or not both):
            wb.delete(key)

    def _put_value(self, wb: rocksdict.WriteBatch, key: bytes, value: bytes | memoryview) -> None:
        record = (value if isinstance(value, bytes) else bytes(value)) if self.plain else wrap(value)
        if len(value) >= BLOB_MIN:
            wb.put(key, record, self._large_cf)
        else:
            wb.put(key, record)

    def _raw(self, key: bytes) -> bytes | None:
        """The stored record of ``key`` from either family (recovery)."""
        return self._large.get(key) or self._db.get(key)

    def usage_by_tag(self) -> dict[Tag, TagUsage]:
        """Tag -> its entries' count and charges, without the store's lock: a put may hold that
        through a write stop (stallwrite.py), and Stats and chunk calls wait on none; as exact
        as tagtable.py says (a put or retag under way may show half done)."""
        return self._tags.usage()

    # ---- server-wide small state ---------------------------------------
    def get_state(self, key: str) -> bytes | None:
        owed = self._state_owed.get(key)  # state a write stop keeps off the disk (keep_state)
        return owed if owed is not None else self._server.get(key.encode())

    def put_state(self, key: str, value: bytes) -> None:
        with self._state_lock:
            self._logged(lambda: puts([(key.encode(), value)], self._server_cf))
            self._state_owed.pop(key, None)  # written over: what was owed for it is no longer
