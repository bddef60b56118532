"""A store's start: its index rebuilt from the meta family, less what a kill lost (Store's part).

With durability "cache" a restart drops index entries whose value was never
flushed (flusher.lost_values); after a salvage (salvage.py) every entry is
checked and values without an index entry are deleted. A write stop that
nothing ends (stallwrite.py) does not stop the start: the deletes it ends are
left for the first flush once writes go again (Store._delete_keys and _delete_soon
strand their ids: a lowered capacity's victims are evicted at once); the durable mark
(_owe_mark) and server state kept meanwhile (keep_state: a repaired chunk table; held
in memory till then) are made before the first put's writes (_pay_owed).
"""
from __future__ import annotations

import logging
import struct
import threading
from typing import Any

from .chunkrefs import STATE_KEY, ChunkTable
from .flusher import lost_values
from .stallwrite import WriteStopped, puts

log = logging.getLogger("cacheserver")
DURABLE_MARK_KEY = b"durable_seq"  # in the "server" column family
_MARK = struct.Struct("<Q")
_META = struct.Struct("<QQi")  # size, sequence, chunk; dataset name follows


class Recovery:
    """Mixed into Store (store.py): the attributes and methods used here are the Store's."""
    _meta: Any
    _server: Any
    _db: Any
    _large: Any
    _server_cf: Any
    _logged: Any
    _stranded: dict[bytes, int]
    progress: Any
    overhead: int
    _mark_owed: int | None = None  # a durable mark a write stop kept off the disk at start
    _owed: Any  # owedeletes.OwedDeletes: deletes a write stop kept off the disk before a restart

    def _recover(self: Any, check_all: bool = False) -> None:
        self._state_owed: dict[str, bytes] = {}  # server state a write stop kept off the disk (keep_state)
        self._state_lock = threading.Lock()  # orders the writes of server state: an owed repair never lands last
        # The chunks the server's table (chunkrefs.py) keeps, until set_protector: a lowered
        # capacity is evicted for below, before a CacheCore loads that table.
        self._protected = ChunkTable.persisted(lambda: self.get_state(STATE_KEY),
                                               lambda raw: self.keep_state(STATE_KEY, raw)).is_protected
        entries, corrupt = [], []
        for key, meta in self._meta.items():
            try:
                size, seq, chunk = _META.unpack_from(meta)
                dataset = bytes(meta[_META.size:]).decode()
            except (struct.error, UnicodeDecodeError):
                corrupt.append(key)
                continue
            entries.append((seq, key, size, (dataset, chunk)))
        self._delete_at_start(corrupt, "corrupt index records")
        self.counters.add("corrupt_dropped", len(corrupt))
        entries = self._drop_owed(entries)
        entries.sort()
        entries = self._recover_unflushed(entries, check_all)
        tids = {tag: self._tags.pin(tag) for tag in {e[3] for e in entries}}  # the tags of what is held
        for seq, key, size, tag in entries:
            self._index_add(key, size + self.overhead, tids[tag])
            self.policy.admitted(key)
            self._seq = max(self._seq, seq + 1)
        for tid in tids.values():
            self._tags.unpin(tid)  # from here on, each goes with its last entry (tagtable.py)
        self.counters.add("recovered_items", len(entries))
        if check_all:
            self._drop_orphans()
        if self.used > self.capacity:  # capacity lowered since last run
            self._evict_to_capacity()  # a write stop strands its victims' deletes (Store._delete_soon)
            if self._stranded:
                log.warning("start: writes are stopped; deleting what evicting down to the capacity "
                            "evicted is left until they go again")
        if not self._stranded:
            self._owed.clear()  # every delete owed went in

    def _drop_owed(self: Any, entries: list) -> list:
        """Delete the entries evicted while writes were stopped before this start (owedeletes.py):
        records of an id below its recorded bound. The sequence goes on past every bound, so that
        no later put of an id falls under one and goes at a restart."""
        owed = self._owed.load()
        if not owed:
            return entries
        gone = [key for seq, key, _, _ in entries if seq < owed.get(key, -1)]
        self._seq = max(self._seq, max(owed.values()))
        if not gone:
            return entries
        self._delete_at_start(gone, "entries evicted while writes were stopped before the restart")
        log.info("start: %d entries evicted while writes were stopped are not indexed again", len(gone))
        dropped = set(gone)
        return [e for e in entries if e[1] not in dropped]

    def _evict_to_capacity(self: Any) -> None:
        """Evict down to the capacity (a restart lowered it), the chunks the server's table
        protects last: held past the capacity, they would leave no room for any put."""
        while self.used > self.capacity and self.evict_for(self.used - self.capacity):
            pass  # again: one pass walks at most LRUPolicy.MAX_SCAN protected entries
        if self.used > self.capacity:
            protected, self._protected = self._protected, lambda tag: False
            try:
                self.evict_for(self.used - self.capacity)
            finally:
                self._protected = protected

    def _recover_unflushed(self: Any, entries: list, check_all: bool = False) -> list:
        """Drop index entries whose value a killed process never flushed (flusher.lost_values)."""
        raw = self._server.get(DURABLE_MARK_KEY)
        if (raw is None and not check_all) or not entries:
            return entries
        if raw is not None and len(raw) != _MARK.size and not check_all:
            # derived state: every entry checked instead (a slower start), rather than no start
            log.warning("the durable mark (server state %r) is %d bytes, not %d: dropped as corrupt; every "
                        "index entry is checked for its value", DURABLE_MARK_KEY.decode(), len(raw), _MARK.size)
            check_all = True
        lost = lost_values(self._raw, entries, 0 if check_all else _MARK.unpack(raw)[0])
        if not lost:
            return entries
        self._delete_at_start(lost, "index records of values never flushed")
        self.counters.add("recovered_unflushed_dropped", len(lost))
        gone = set(lost)
        return [e for e in entries if e[1] not in gone]

    def _drop_orphans(self: Any) -> None:
        """Delete values whose index entry a salvage lost: no one could evict them."""
        orphans = [k for k in (*self._db.keys(), *self._large.keys()) if k not in self._index]
        self._delete_at_start(orphans, "values without an index record")
        self.counters.add("salvage_orphans_dropped", len(orphans))

    def _delete_at_start(self: Any, keys: list[bytes], what: str) -> None:
        """Delete ``keys`` (out of the index) at start; a write stop leaves them stranded
        (Store._delete_keys) for the first flush once writes go again, and a restart before
        that finds them as this one did."""
        if not keys:
            return
        try:
            if self.progress.refusing() is None:  # not another STUCK_S once a write gave up
                self._delete_keys(keys)
                return
        except WriteStopped:
            pass
        for k in keys:
            self._stranded.setdefault(k, self._seq)
        self._owed.record((k, self._stranded[k]) for k in keys)
        log.warning("start: writes are stopped; deleting %d %s is left until they go again", len(keys), what)

    def _owe_mark(self: Any) -> None:
        """Write the durable mark of a start (all recovered values are in table files; not past the
        ids left stranded); one a write stop keeps off the disk is owed: written before the first
        put's index records (_pay_mark), as an older mark would not cover those."""
        mark = min(self._stranded.values(), default=self._seq)
        try:
            if self.progress.refusing() is None:
                self._set_durable_mark(mark)
                return
        except WriteStopped:
            pass
        self._mark_owed = mark
        log.warning("start: writes are stopped; the durable mark is written before the first put")

    def keep_state(self, key: str, value: bytes) -> None:
        """Save server state the store's holder derives and can set again (the chunk table:
        chunkrefs.py; its repair at start too). While a write stop keeps it off the disk it is
        owed, not an error: get_state answers it, the first put or flush writes it (_pay_owed,
        _retry_soon), and no caller waits out the stop (a start's readers, the manager's calls:
        an EvictChunk's save of the table waited STUCK_S, past the manager's deadline)."""
        with self._state_lock:
            first = key not in self._state_owed
            self._state_owed[key] = value
        try:
            if self.progress.refusing() is None and self._pay_state(wait=False):
                return
        except WriteStopped:  # a closing store's
            pass
        except Exception as e:  # RocksDB's own error fails the store, as a put's does
            self._put_failed(e)
            raise
        self._retry_soon()
        if first:
            log.warning("writes are stopped; server state %r is written once they go again", key)

    def _pay_state(self: Any, wait: bool = True) -> bool:
        """Write the state owed; ``wait``: waiting out a write stop, else one try each. Whether all went in."""
        with self._state_lock:
            for key, value in list(self._state_owed.items()):
                build = (lambda k=key.encode(), v=value: puts([(k, v)], self._server_cf))
                if wait:
                    self._logged(build)
                elif not self._logged.once(build):
                    return False
                del self._state_owed[key]
        return True

    def _pay_owed(self: Any) -> None:
        """What a write stop kept off the disk, before a put's writes: server state (keep_state),
        and the durable mark (_owe_mark) before index records of values that skip the
        log, as an older mark would not cover those. Raises WriteStopped while the stop lasts
        (the put fails, as its own write would)."""
        if self._state_owed:
            self._pay_state()
        if self._mark_owed is not None:
            with self._state_lock:  # after a flush's newer mark (_flushed_mark) it is owed no more
                if self._mark_owed is not None:
                    self._set_durable_mark(self._mark_owed)
                    self._mark_owed = None

    def _flushed_mark(self, seq: int) -> None:
        """The durable mark of a flush; it covers a mark owed from start, which, written after
        it, set the mark back (values from the older mark on checked again at restart)."""
        with self._state_lock:
            self._set_durable_mark(seq)
            self._mark_owed = None

    def _set_durable_mark(self, seq: int) -> None:
        self._logged(lambda: puts([(DURABLE_MARK_KEY, _MARK.pack(seq))], self._server_cf))

