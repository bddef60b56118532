"""A store's evictions (Store's part): room made for puts (spare entries first, then the
fallback policy, sparing protected chunks) and the manager's evictions by tag. Each
deletes its victims' records under the store's lock, so that no put of one of them
interleaves; so none waits out a write stop with the lock held: one try, and what a stop
refuses is left for the first flush once writes go (Store._delete_soon). Also the rewrite
of the oldest blob values (relocate_oldest), so that blob files the evictions left mostly
dead can go (diskbudget.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .diskbudget import BLOB_MIN
from .stallwrite import puts
from .tagtable import Tag


class Evictions:
    """Mixed into Store (store.py): the attributes and methods used here are the Store's."""
    _lock: Any
    _index: dict[bytes, tuple[int, int]]
    _spare: Any
    _tags: Any
    _hits: Any
    _protected: Callable[[Tag], bool]
    policy: Any
    counters: Any
    overhead: int  # store.OVERHEAD, every entry's charge on top of its value
    _aged: Any  # values in blob files, oldest write first: id -> charge
    _pending: set[bytes]
    _large: Any
    _large_cf: Any
    _unlogged: Any
    _put_failed: Callable[[BaseException], None]

    def evict_for(self, need: int, spare_only: bool = False) -> int:
        """Free at least `need` bytes (lock held): spare entries first, least recently
        used first, whatever the policy; then, unless spare_only, the fallback policy.
        The victims are misses at once; their deletes wait out no write stop (Store._delete_soon)."""
        self._hits.apply()  # the order as every get so far left it
        freed, victims, large, spare = 0, [], [], self._spare
        while spare and freed < need:
            key = next(iter(spare))
            freed += self._remove_victim(key, victims, large)  # drops it from spare too
        n_spare = len(victims)
        if freed < need and not spare_only:
            protected = self._protected
            for key in self.policy.victims(lambda k: protected(self._tags[self._index[k][1]])
                                           if k in self._index else False):
                freed += self._remove_victim(key, victims, large)
                if freed >= need:
                    break
        if victims:
            try:  # one try (the lock is held: a wait for a stop held every put and adopt up to STUCK_S)
                self._delete_soon(victims, large, raising=True)  # a stop strands them, deleted once writes go
            finally:  # out of the index and the usage either way (a stopped delete goes in later)
                self.counters.add_many({"evicted_spare": n_spare, "evicted_by_policy": len(victims) - n_spare,
                                        "evicted_items": len(victims), "evicted_bytes": freed})
        return freed

    def _remove_victim(self, key: bytes, victims: list[bytes], large: list[bytes]) -> int:
        charge = self._index_remove(key)
        victims.append(key)
        if charge >= BLOB_MIN + self.overhead:
            large.append(key)
        return charge

    def evict_tags(self, match: Callable[[Tag], bool]) -> tuple[int, int]:
        """Delete every entry whose tag matches (manager-directed eviction). Its ids are misses
        at once; their deletes wait out no write stop (the manager's call would run past its
        deadline, and every put wait for the lock): one try, and what a stop refused is stranded,
        deleted once writes go again (Store._delete_soon). RocksDB's own error is raised."""
        victims: list[bytes] = []
        large: list[bytes] = []
        with self._lock:
            tids = self._tags.matching(match)
            keys = [k for k, (_, tid) in self._index.items() if tid in tids]
            freed = sum(self._remove_victim(k, victims, large) for k in keys)
            try:
                if keys:  # under the lock, as evict_for: a put of one of them in between would be deleted
                    self._delete_soon(keys, large, raising=True)  # RocksDB's own error: the manager hears of it
            finally:  # out of the index and the usage either way (a stopped delete goes in later)
                if keys:
                    self.counters.add_many({"evicted_items": len(keys), "evicted_bytes": freed})
        return len(keys), freed

    def relocate_oldest(self, max_bytes: int) -> int:
        """Rewrite the oldest values in blob files (same id, same record), at most ``max_bytes``:
        the files they pin among evicted values go once compaction drops the old copies. Under
        the lock, so that no eviction or replace of those ids interleaves, and so one try (a stop's wait
        held every put and adopt): a stop moves nothing, and admission tries again. Returns bytes moved.
        A failed write changes nothing (its batch goes in whole or not at all; the order and the
        counts move after it) and, as a put's, fails the store where it is RocksDB's (_put_failed)."""
        moved, records = 0, []
        with self._lock:
            for key, charge in self._aged.items():
                if moved >= max_bytes:
                    break
                if key in self._pending:
                    continue
                raw = self._large.get(key)
                if raw is not None:
                    records.append((key, raw))
                    moved += charge
            keys = [k for k, _ in records]
            if keys:
                try:
                    if not self._unlogged.once(lambda: puts(records, self._large_cf)):
                        return 0
                except BaseException as e:
                    self._put_failed(e)
                    raise
                for key in keys:
                    self._aged.move_to_end(key)
        if keys:
            self.counters.add_many({"relocated_items": len(keys), "relocated_bytes": moved})
        return moved
