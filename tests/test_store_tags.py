"""The store's tag table (cacheserver/tagtable.py): a tag lives while an entry has it
or a put writes under it, in memory as after a restart, whatever removed the entries."""
import os
import random

import pytest

from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import OVERHEAD, UNTAGGED, Store
from cacheserver.storerecovery import _META

SLOT = 100 + OVERHEAD


def ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def tags_held(s):
    """The tags in the table, checked against the usage the store reports."""
    usage = s.usage_by_tag()
    assert len(s._tags) == len(usage), "a tag with no entry stayed in the table"
    return set(usage)


def tags_on_disk(s):
    """The tags the index records name (what a restart rebuilds the table from)."""
    out = set()
    for _, meta in s._meta.items():
        _, _, chunk = _META.unpack_from(meta)
        out.add((bytes(meta[_META.size:]).decode(), chunk))
    return out


def test_evicted_chunks_and_datasets_leave_the_table_and_the_disk(tmp_path):
    path = str(tmp_path / "t")
    s = Store(path, 1000 * SLOT, LRUPolicy(), Counters())
    for c in range(40):  # 4 datasets of 10 chunks, 2 items each
        s.put_many([(k, b"v" * 100) for k in ids(2, seed=c)], (f"ds{c // 10}", c))
    s.put_many([(k, b"u" * 100) for k in ids(2, seed=99)])  # untagged
    assert len(tags_held(s)) == 41
    for c in range(10):  # every chunk of ds0, by the manager
        assert s.evict_tags(lambda tag, c=c: tag == ("ds0", c))[0] == 2
    s.evict_tags(lambda tag: tag[0] == "ds1")
    held = tags_held(s)
    assert held == {(f"ds{c // 10}", c) for c in range(20, 40)} | {UNTAGGED}
    assert tags_on_disk(s) == held
    s.close()
    s = Store(path, 1000 * SLOT, LRUPolicy(), Counters())  # the same table after a restart
    try:
        assert tags_held(s) == held and tags_on_disk(s) == held
    finally:
        s.close()


def test_lru_churn_over_many_chunks_keeps_only_the_tags_held(tmp_path):
    """A long-running server seeing chunk after chunk: the fallback policy evicts the
    old ones, and the table holds no more tags than there are entries."""
    s = Store(str(tmp_path / "c"), 20 * SLOT, LRUPolicy(), Counters())
    try:
        for c in range(300):
            s.put_many([(os.urandom(32), b"x" * 100) for _ in range(2)], (f"ds{c // 10}", c))
        assert s.items == 20 and s.counters["evicted_by_policy"] == 600 - 20
        assert tags_held(s) == {(f"ds{c // 10}", c) for c in range(290, 300)}
    finally:
        s.close()


def test_spare_tag_goes_when_its_entries_join_a_chunk(tmp_path):
    s = Store(str(tmp_path / "a"), 100 * SLOT, LRUPolicy(), Counters())
    try:
        ks = ids(4, seed=1)
        s.put_many([(k, b"s" * 100) for k in ks], ("ds", -1))
        assert s.adopt(ks[:2], ("ds", 3)) == b"\x01\x01"
        assert tags_held(s) == {("ds", -1), ("ds", 3)}
        assert s.put_many([(k, b"s" * 100) for k in ks[2:]], ("ds", 3)) == (0, 2, 0)  # retagged by the put
        assert tags_held(s) == {("ds", 3)} and tags_on_disk(s) == {("ds", 3)}
        assert s.usage_by_tag()[("ds", 3)].items == 4
    finally:
        s.close()


def test_a_corrupt_entry_dropped_on_read_takes_its_tag_along(tmp_path):
    s = Store(str(tmp_path / "b"), 100 * SLOT, LRUPolicy(), Counters())
    try:
        k = ids(1, seed=2)[0]
        s.put_many([(k, b"c" * 100)], ("ds", 7))
        s._db.put(k, b"garbage-without-a-valid-trailer")
        assert s.get_many([k]) == [None] and s.counters["corrupt_dropped"] == 1
        assert tags_held(s) == set() and tags_on_disk(s) == set()
    finally:
        s.close()


def test_tags_evicted_at_recovery_for_a_smaller_capacity_are_gone(tmp_path):
    path = str(tmp_path / "r")
    s = Store(path, 10 * SLOT, LRUPolicy(), Counters())
    for c in range(10):
        s.put_many([(ids(1, seed=c)[0], b"r" * 100)], ("ds", c))
    s.close()
    s = Store(path, 4 * SLOT, LRUPolicy(), Counters())  # the 6 oldest chunks go while it starts
    try:
        assert tags_held(s) == {("ds", c) for c in range(6, 10)} and tags_on_disk(s) == tags_held(s)
    finally:
        s.close()


@pytest.mark.parametrize("fits", [True, False])
def test_replacing_the_only_entry_of_a_tag_keeps_the_tag_while_writing(tmp_path, fits):
    """A replace takes the old entry out of the index before the new value is written: the
    put holds its tag meanwhile, so the new entry goes in under it (or, refused, the tag goes)."""
    cap = (100 if fits else 1000) * SLOT
    s = Store(str(tmp_path / "p"), cap, LRUPolicy(), Counters())
    try:
        k = ids(1, seed=3)[0]
        s.put_many([(k, b"o" * 100)], ("ds", 1))
        value = b"n" * (100 if fits else cap)  # one larger than the capacity finds no room
        assert s.put_many([(k, value)], ("ds", 1), replace=True) == ((1, 0, 0) if fits else (0, 0, 1))
        assert tags_held(s) == ({("ds", 1)} if fits else set())
        assert tags_on_disk(s) == tags_held(s)
        if fits:
            assert bytes(s.get_many([k])[0]) == value
    finally:
        s.close()


def test_a_large_value_is_aged_before_readers_without_the_lock_see_it(tmp_path):
    """get_many and touch_split read the index without the store's lock: once an id is
    there, a large value must already be in _aged, or they look in the wrong family
    (get_many then dropped a good value as corrupt)."""
    from cacheserver.diskbudget import BLOB_MIN

    seen: list[bool] = []

    class Checked(dict):
        def __setitem__(self, key, value):
            seen.append(key in s._aged)
            super().__setitem__(key, value)

    s = Store(str(tmp_path / "a"), 64 * (BLOB_MIN + OVERHEAD), LRUPolicy(), Counters())
    try:
        s._index = Checked(s._index)
        k = ids(1, seed=9)[0]
        s.put_many([(k, os.urandom(BLOB_MIN + 10))])
        assert seen == [True]
        assert bytes(s.get_many([k])[0]) is not None and s.counters.snapshot().get("corrupt_dropped", 0) == 0
    finally:
        s.close()
