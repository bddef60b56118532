"""Store and core unit tests: capacity accounting, eviction, corruption, validation."""
import os
import random
import threading

import pytest
import rocksdict

from cacheserver.core import CacheCore, Limits
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy, NoEviction, make_policy
from cacheserver.vocab import BadRequest, CacheMode
from cacheserver.store import OVERHEAD, Store


def ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "s"), 100 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    yield s
    s.close()


def test_put_get_roundtrip_and_duplicates(store):
    ks = ids(10)
    vals = [os.urandom(1000) for _ in ks]
    assert store.put_many(list(zip(ks, vals))) == (10, 0, 0)
    assert store.put_many(list(zip(ks, vals))) == (0, 10, 0)
    assert [bytes(v) for v in store.get_many(ks)] == vals
    assert store.contains(ks + ids(1, seed=9)) == b"\x01" * 10 + b"\x00"
    assert store.used == 10 * (1000 + OVERHEAD) and store.items == 10


def test_capacity_never_exceeded_under_8_concurrent_writers(tmp_path):
    cap = 200 * (2000 + OVERHEAD)
    s = Store(str(tmp_path / "c"), cap, NoEviction(), Counters())
    peak, errors = [0], []

    def writer(seed):
        try:
            for b in range(20):
                batch = [(k, os.urandom(2000)) for k in ids(10, seed=seed * 1000 + b)]
                s.put_many(batch)
                peak[0] = max(peak[0], s.used + s._reserved)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert s.used <= cap and peak[0] <= cap
    assert s.items == 200  # exactly full: 1600 offered, 200 fit
    assert s.counters["rejected_full"] == 1600 - 200
    s.close()


def test_lru_fallback_evicts_oldest_unprotected(tmp_path):
    s = Store(str(tmp_path / "l"), 10 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    old = ids(5, seed=1)
    hot = ids(5, seed=2)
    s.put_many([(k, b"o" * 1000) for k in old], ("ds", 0))
    s.put_many([(k, b"h" * 1000) for k in hot])
    s.set_protector(lambda tag: tag == ("ds", 0))  # chunk 0 referenced: keep it
    s.get_many(hot[:2])  # recently used
    new = ids(3, seed=3)
    assert s.put_many([(k, b"n" * 1000) for k in new]) == (3, 0, 0)
    assert s.contains(old) == b"\x01" * 5  # protected
    assert s.contains(hot[:2]) == b"\x01\x01"  # recently used
    assert s.contains(hot[2:]) == b"\x00" * 3  # evicted
    assert s.counters["evicted_by_policy"] == 3
    s.close()


@pytest.mark.parametrize("policy", ["lru", "none"])
def test_spare_entries_go_first_and_evict_only_their_kind(tmp_path, policy):
    """(dataset, -1): a dataset's items outside the manager's chunks fill room nobody was
    given; any put evicts them first (least recently used first), and they evict only each other."""
    slot = 1000 + OVERHEAD
    s = Store(str(tmp_path / "sp"), 10 * slot, make_policy(policy), Counters())
    chunk = ids(4, seed=1)
    spare = ids(6, seed=2)
    assert s.put_many([(k, b"c" * 1000) for k in chunk], ("ds", 3)) == (4, 0, 0)
    assert s.put_many([(k, b"s" * 1000) for k in spare], ("ds", -1)) == (6, 0, 0)  # full now
    s.touch(spare[:2])  # recently used spares outlive the others
    more = ids(3, seed=3)
    assert s.put_many([(k, b"m" * 1000) for k in more], ("ds", -1)) == (3, 0, 0)
    assert s.contains(spare) == b"\x01\x01" + b"\x00" * 3 + b"\x01" and s.contains(chunk) == b"\x01" * 4
    # a spare put may not evict chunk entries, even under LRU: room left = spares only
    many = ids(8, seed=4)
    assert s.put_many([(k, b"x" * 1000) for k in many], ("ds", -1)) == (6, 0, 2)
    assert s.contains(chunk) == b"\x01" * 4
    # a chunk put (the loading chunk) takes spare room first, whatever the policy
    loading = ids(5, seed=5)
    assert s.put_many([(k, b"l" * 1000) for k in loading], ("ds", 4)) == (5, 0, 0)
    assert s.contains(chunk) == b"\x01" * 4 and s.contains(loading) == b"\x01" * 5
    assert s.counters["evicted_spare"] == 3 + 6 + 5 and s.counters["evicted_by_policy"] == 0
    assert s.used == 10 * slot
    s.close()
    # spares are known again after a restart (rebuilt from the index)
    s = Store(str(tmp_path / "sp"), 10 * slot, make_policy(policy), Counters())
    assert len(s._spare) == 1 and s.put_many([(ids(1, seed=6)[0], b"y" * 1000)], ("ds", 5)) == (1, 0, 0)
    assert s.contains(chunk + loading) == b"\x01" * 9
    s.close()


def test_a_spare_entry_put_again_under_a_chunk_joins_it(tmp_path):
    """Spare first (its chunk had no room then), then the chunk is loaded: the put
    retags it, so chunk protection and accounting cover it, also after a restart."""
    slot = 1000 + OVERHEAD
    s = Store(str(tmp_path / "rt"), 10 * slot, make_policy("lru"), Counters())
    ks = ids(5, seed=7)
    s.put_many([(k, b"s" * 1000) for k in ks], ("ds", -1))
    assert s.contains(ks, not_spare=True) == b"\x00" * 5 and s.contains(ks) == b"\x01" * 5
    assert s.put_many([(k, b"s" * 1000) for k in ks[:3]], ("ds", 3)) == (0, 3, 0)  # present: retagged
    assert s.counters["put_retagged"] == 3
    assert s.contains(ks, not_spare=True) == b"\x01\x01\x01\x00\x00"
    usage = s.usage_by_tag()
    assert usage[("ds", 3)].items == 3 and usage[("ds", -1)].items == 2
    s.set_protector(lambda tag: tag == ("ds", 3))
    for b in range(3):  # spare churn evicts only the two that stayed spare
        s.put_many([(k, b"x" * 1000) for k in ids(4, seed=100 + b)], ("ds", -1))
    assert s.contains(ks) == b"\x01\x01\x01\x00\x00" and s.used <= 10 * slot
    s.close()
    s = Store(str(tmp_path / "rt"), 10 * slot, make_policy("lru"), Counters())
    assert s.usage_by_tag()[("ds", 3)].items == 3  # the new tag was logged
    assert [bytes(v) for v in s.get_many(ks[:3])] == [b"s" * 1000] * 3
    s.close()


def test_retag_keeps_unflushed_state_and_needs_a_chunk(tmp_path):
    s = Store(str(tmp_path / "ru"), 10**7, LRUPolicy(), Counters())
    s._flusher.stop()  # keep the values unflushed
    try:
        ks = ids(3, seed=21)
        s.put_many([(k, b"u" * 100) for k in ks], ("ds", -1))
        s.put_many([(k, b"u" * 100) for k in ks[:1]])  # untagged: leaves it spare
        s.put_many([(k, b"u" * 100) for k in ks[1:2] * 2], ("ds", 4))  # the same id twice: once
        assert s.counters["put_retagged"] == 1
        assert s.contains(ks, not_spare=True) == b"\x00\x01\x00"
        # a follower still cannot see the retagged value: it must still come inline
        assert s.touch_split(ks) == (b"\x01" * 3, [0, 1, 2])
    finally:
        s.close()


def test_adopt_retags_spare_entries_in_place_and_logs_it(tmp_path):
    slot = 1000 + OVERHEAD
    s = Store(str(tmp_path / "ad"), 10 * slot, make_policy("lru"), Counters())
    ks = ids(4, seed=8)
    s.put_many([(k, b"a" * 1000) for k in ks[:3]], ("ds", -1))
    s.put_many([(ks[3], b"b" * 1000)], ("ds", 0))
    assert s.adopt(ks[:2] + ks[:1] + ks[3:] + ids(1, seed=9), ("ds", 6)) == b"\x01\x01\x01\x01\x00"
    assert s.counters["adopted"] == 2 and s.counters["put_retagged"] == 0
    usage = s.usage_by_tag()
    assert usage[("ds", 6)].items == 2 and usage[("ds", -1)].items == 1 and usage[("ds", 0)].items == 1
    with pytest.raises(ValueError, match="chunk tag"):
        s.adopt(ks, ("ds", -1))
    s.close()
    s = Store(str(tmp_path / "ad"), 10 * slot, make_policy("lru"), Counters())
    assert s.usage_by_tag()[("ds", 6)].items == 2 and len(s._spare) == 1  # the new tags were logged
    assert [bytes(v) for v in s.get_many(ks[:2])] == [b"a" * 1000] * 2
    s.close()


def test_full_with_no_eviction_rejects_without_partial_state(tmp_path):
    s = Store(str(tmp_path / "n"), 3 * (1000 + OVERHEAD), make_policy("none"), Counters())
    ks = ids(5)
    assert s.put_many([(k, b"v" * 1000) for k in ks]) == (3, 0, 2)
    assert s.contains(ks) == b"\x01\x01\x01\x00\x00"
    assert s.used == 3 * (1000 + OVERHEAD)
    s.close()


def test_an_item_larger_than_the_capacity_evicts_nothing(tmp_path):
    s = Store(str(tmp_path / "big"), 4 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    ks = ids(4)
    assert s.put_many([(k, b"v" * 1000) for k in ks]) == (4, 0, 0)
    big, small = ids(2, seed=5)
    assert s.put_many([(big, b"b" * 5000), (small, b"s" * 1000)]) == (1, 0, 1)  # room made for the one that fits
    assert s.contains(ks + [big, small]) == b"\x00\x01\x01\x01\x00\x01"
    assert s.counters["evicted_items"] == 1
    s.close()


def test_an_eviction_never_deletes_a_put_made_while_it_runs(tmp_path):
    """Ids are content digests, so another dataset may put an id that a manager-directed
    eviction is removing: the put waits for the delete, and then stores it."""
    s = Store(str(tmp_path / "ev"), 10**7, LRUPolicy(), Counters())
    k, value, puts, threads = ids(1)[0], os.urandom(1000), [], []
    s.put_many([(k, value)], ("A", 0))
    delete = s._delete_soon

    def put_meanwhile(keys, large=None, raising=False):
        t = threading.Thread(target=lambda: puts.append(s.put_many([(k, value)], ("B", 0))))
        t.start()
        t.join(0.3)  # it cannot finish while the eviction holds the lock
        delete(keys, large, raising)
        threads.append(t)

    s._delete_soon = put_meanwhile
    assert s.evict_tags(lambda tag: tag[0] == "A") == (1, 1000 + OVERHEAD)
    threads[0].join(10)
    assert puts == [(1, 0, 0)] and bytes(s.get_many([k])[0]) == value
    assert s.counters["corrupt_dropped"] == 0
    s.close()


def test_corrupt_value_is_dropped_counted_and_never_served(tmp_path):
    s = Store(str(tmp_path / "x"), 10**7, LRUPolicy(), Counters())
    ks = ids(3)
    s.put_many([(k, b"good" * 100) for k in ks])
    s._db.put(ks[1], b"bad!" * 100 + b"\0" * 8)  # flip the stored record under the store
    out = s.get_many(ks)
    assert bytes(out[0]) == b"good" * 100 and out[1] is None and bytes(out[2]) == b"good" * 100
    assert s.counters["corrupt_dropped"] == 1
    assert s.contains(ks) == b"\x01\x00\x01"
    assert s.used == 2 * (400 + OVERHEAD)
    s.close()


def test_get_answers_from_the_index_an_unindexed_record_is_a_miss(tmp_path):
    """Ids the index does not hold are misses without a RocksDB read: a record under the
    store that no put indexed (stray, or a put not finished) is not served, and not
    counted as corrupt; an indexed record whose value is gone is still dropped."""
    from cacheserver.record import wrap

    s = Store(str(tmp_path / "u"), 10**7, LRUPolicy(), Counters())
    ks = ids(4)
    s.put_many([(k, b"kept" * 50) for k in ks[:2]])
    s._db.put(ks[2], wrap(b"stray" * 40))  # a well-formed record the store never indexed
    out = s.get_many(ks, trailer=False)
    assert [bytes(v) for v in out[:2]] == [b"kept" * 50] * 2 and out[2:] == [None, None]
    assert s.counters["corrupt_dropped"] == 0 and s.contains(ks) == b"\x01\x01\x00\x00"
    s._db.delete(ks[1])  # meta without value
    assert s.get_many(ks[:2])[1] is None
    assert s.counters["corrupt_dropped"] == 1 and s.contains(ks[:2]) == b"\x01\x00"
    assert s.used == 200 + OVERHEAD
    s.close()


def test_restart_rebuilds_index_and_lowered_capacity_evicts(tmp_path):
    path = str(tmp_path / "r")
    s = Store(path, 10**7, LRUPolicy(), Counters())
    ks = ids(20)
    s.put_many([(k, b"z" * 1000) for k in ks], ("ds", 2))
    s.close()
    s = Store(path, 10**7, LRUPolicy(), Counters())
    assert s.items == 20 and s.counters["recovered_items"] == 20
    assert s.usage_by_tag()[("ds", 2)].items == 20
    s.close()
    s = Store(path, 10 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    assert s.items == 10 and s.used <= s.capacity
    assert s.contains(ks[10:]) == b"\x01" * 10  # the oldest went first
    s.close()


def test_unreadable_meta_is_dropped_at_recovery(tmp_path):
    path = str(tmp_path / "m")
    s = Store(path, 10**7, LRUPolicy(), Counters())
    ks = ids(2)
    s.put_many([(k, b"q" * 10) for k in ks])
    s._meta.put(ks[0], b"\x01")  # too short to be a meta record
    s.close()
    s = Store(path, 10**7, LRUPolicy(), Counters())
    assert s.contains(ks) == b"\x00\x01" and s.counters["corrupt_dropped"] == 1
    assert s.get_many(ks[:1]) == [None]
    s.close()


def test_core_validation_refuses_whole_batch(tmp_path):
    s = Store(str(tmp_path / "v"), 10**7, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters, Limits(max_item_bytes=100, max_batch_bytes=1000, max_batch_items=50))
    good = ids(2)
    cases = [
        ([(good[0], 3, b"abc"), (b"short", 3, b"abc")], "items\\[1\\].id: expected a 32-byte id"),
        ([(good[0], 3, b"abc"), (good[1], 4, b"abc")], "items\\[1\\]: declared size 4 but value has 3"),
        ([(good[0], 101, b"x" * 101)], "exceeds the item limit of 100"),
        ([(k, 100, b"x" * 100) for k in ids(11)], "exceeds the limit of 1000"),
    ]
    for items, msg in cases:
        with pytest.raises(BadRequest, match=msg):
            core.put("j", items)
    assert s.items == 0  # nothing partial
    with pytest.raises(BadRequest, match="50"):
        core.lookup("j", ids(51))
    with pytest.raises(BadRequest, match="chunk tag needs a dataset"):
        core.put("j", [(good[0], 1, b"a")], "", 3)
    s.close()


def test_bypass_mode_answers_miss_only_for_that_job(tmp_path):
    s = Store(str(tmp_path / "b"), 10**7, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters)
    ks = ids(4)
    core.put("a", [(k, 2, b"hi") for k in ks])
    assert core.set_job_mode("probe", CacheMode.BYPASS.code) == CacheMode.NORMAL.code
    assert core.lookup("probe", ks) == b"\0" * 4 and core.get("probe", ks) == [None] * 4
    assert core.get_local("probe", ks) == b"\0" * 4
    assert core.lookup("other", ks) == b"\1" * 4
    assert core.set_job_mode("probe", CacheMode.NORMAL.code) == CacheMode.BYPASS.code
    assert [bytes(v) for v in core.get("probe", ks)] == [b"hi"] * 4
    assert s.counters["bypassed"] == 12
    s.close()


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


def test_rocksdb_files_are_where_we_say(tmp_path):
    s = Store(str(tmp_path / "p"), 10**6, LRUPolicy(), Counters())
    assert s.db_path == str(tmp_path / "p" / "db")
    s.close()
    assert "meta" in rocksdict.Rdict.list_cf(str(tmp_path / "p" / "db"))


def test_replace_overwrites_and_reaccounts(tmp_path):
    s = Store(str(tmp_path / "rp"), 10**7, LRUPolicy(), Counters())
    k = ids(1)[0]
    s.put_many([(k, b"old" * 10)])
    assert s.put_many([(k, b"new" * 20)]) == (0, 1, 0)  # plain put keeps what is there
    assert s.put_many([(k, b"new" * 20)], replace=True) == (1, 0, 0)
    assert bytes(s.get_many([k])[0]) == b"new" * 20
    assert s.items == 1 and s.used == 60 + OVERHEAD
    s.close()


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_a_replaced_record_leaves_nothing_behind(tmp_path, durability):
    """A replace whose new value goes to the other family than the old one deletes the old
    record; one that finds no room deletes the (poisoned) record it would have replaced:
    neither lies on disk unindexed or survives the id's eviction."""
    from cacheserver.diskbudget import BLOB_MIN

    path = str(tmp_path / "rl")
    s = Store(path, 4 * BLOB_MIN, LRUPolicy(), Counters(), durability=durability)
    a, b, c = ids(3, seed=7)
    s.put_many([(a, os.urandom(BLOB_MIN)), (b, os.urandom(1000))], ("ds", 0))
    assert s.put_many([(a, b"small" * 200), (b, os.urandom(BLOB_MIN))], ("ds", 0), replace=True) == (2, 0, 0)
    assert [len(bytes(v)) for v in s.get_many([a, b])] == [1000, BLOB_MIN]
    s.put_many([(c, os.urandom(BLOB_MIN))], ("ds", 0))
    assert s.put_many([(c, os.urandom(5 * BLOB_MIN))], ("ds", 0), replace=True) == (0, 0, 1)  # no room
    assert s.contains([c]) == b"\x00"
    s.flush()
    assert list(s._large.keys()) == [b] and list(s._db.keys()) == [a]  # one record per held id
    assert s.evict_tags(lambda t: t[0] == "ds")[0] == 2
    s.close()
    s = Store(path, 4 * BLOB_MIN, LRUPolicy(), Counters(), durability=durability)
    assert s.items == 0 and not list(s._large.keys()) and not list(s._db.keys())
    s.close()


def test_flush_for_followers_only_when_the_memtable_is_large(tmp_path):
    import glob

    from cacheserver.client.localread import LocalReader
    from cacheserver.storeflush import FOLLOWER_FLUSH_MIN_BYTES

    s = Store(str(tmp_path / "st"), 1 << 30, make_policy("lru"), Counters())
    try:
        s.put_many([(k, b"v" * 1000) for k in ids(10, seed=1)])
        assert not s.flush_for_followers()  # a small log: a follower replays it quickly
        big = ids(48, seed=2)  # values below diskbudget.BLOB_MIN: in the table files, where followers read
        s.put_many([(k, os.urandom(FOLLOWER_FLUSH_MIN_BYTES // 32)) for k in big])
        assert s.flush_for_followers()
        assert not s.flush_for_followers()  # nothing left in memory
        logs = glob.glob(os.path.join(s.db_path, "*.log"))
        assert sum(os.path.getsize(f) for f in logs) < FOLLOWER_FLUSH_MIN_BYTES  # the log went too
        reader = LocalReader(s.db_path)
        try:
            assert all(v is not None for v in reader.read(big))  # flushed data stays readable
        finally:
            reader.close()
    finally:
        s.close()


def test_durability_is_checked_and_named(tmp_path):
    with pytest.raises(ValueError, match="durability must be one of cache, process, power"):
        Store(str(tmp_path / "d"), 10**6, LRUPolicy(), Counters(), durability="fast")


def test_recovery_drops_an_index_entry_whose_unlogged_value_was_lost(tmp_path):
    # durability "cache": a kill -9 before the flush leaves the logged meta of a
    # value that never reached a table file; only entries from the durable mark on
    # are checked, and those without a value are dropped, not served or counted.
    from cacheserver.store import _META

    path = str(tmp_path / "u")
    s = Store(path, 10**7, LRUPolicy(), Counters())
    kept, lost = ids(3, seed=7), ids(1, seed=8)[0]
    s.put_many([(k, b"k" * 100) for k in kept], tag=("ds", 0))
    s._meta.put(lost, _META.pack(100, 10**9, 0) + b"ds")  # as if its value died with the process
    s.close()
    s = Store(path, 10**7, LRUPolicy(), Counters())
    try:
        assert s.counters["recovered_unflushed_dropped"] == 1 and s.counters["recovered_items"] == 3
        assert s.contains(kept + [lost]) == b"\x01\x01\x01\x00"
        assert s.used == 3 * (100 + OVERHEAD)
        assert [bytes(v) for v in s.get_many(kept)] == [b"k" * 100] * 3
    finally:
        s.close()


@pytest.mark.parametrize("durability", ["process", "power"])
def test_logged_durability_writes_value_and_meta_together(tmp_path, durability):
    path = str(tmp_path / durability)
    s = Store(path, 10**7, LRUPolicy(), Counters(), durability=durability)
    ks = ids(4, seed=9)
    s.put_many([(k, b"p" * 50) for k in ks])
    assert s._flusher is None and s._wopts.sync == (durability == "power")
    s.close()
    s = Store(path, 10**7, LRUPolicy(), Counters(), durability=durability)
    try:
        assert [bytes(v) for v in s.get_many(ks)] == [b"p" * 50] * 4
    finally:
        s.close()


def test_flush_policy_waits_for_a_pause_or_an_age():
    from cacheserver.flusher import MAX_AGE_S, QUIET_S, READ_FLUSH_GAP_S, READ_QUIET_S, should_flush

    assert not should_flush(100.0, None, 99.0)  # nothing unflushed
    assert not should_flush(100.0, 99.9, 99.95)  # writes going on, young
    assert should_flush(100.0, 99.0, 100.0 - QUIET_S)  # writes paused
    assert should_flush(100.0, 100.0 - MAX_AGE_S, 100.0)  # never paused, but old enough
    assert not should_flush(100.0, 100.0 - MAX_AGE_S + 0.01, 99.99)
    # unflushed values read since the last write (followers cannot see them): a short pause will do
    assert should_flush(100.0, 99.0, 100.0 - 1.5 * READ_QUIET_S, 99.99)
    assert not should_flush(100.0, 99.0, 100.0 - READ_QUIET_S / 2, 99.99)  # writes still going on
    assert not should_flush(100.0, 99.0, 100.0 - 1.5 * READ_QUIET_S, 99.0)  # read before the last write
    assert not should_flush(100.0, 99.0, 100.0 - 1.5 * READ_QUIET_S, 99.99, 100.0 - READ_FLUSH_GAP_S / 2)  # just flushed


def test_reading_unflushed_values_is_noted_for_the_flusher(tmp_path):
    s = Store(str(tmp_path / "r"), 10**7, LRUPolicy(), Counters())
    s._flusher.stop()  # a stalled host must not let it flush between the put and the read
    try:
        ks = ids(3, seed=11)
        s.put_many([(k, b"r" * 100) for k in ks])
        dirty_since, last_write, last_read = s._dirty_state()
        assert dirty_since is not None and last_read < last_write
        assert s.touch_split(ks[:2] + ids(1, seed=12)) == (b"\x01\x01\x00", [0, 1])  # both unflushed
        assert s._dirty_state()[2] > last_write  # -> should_flush's short pause applies
    finally:
        s.close()


def test_the_flusher_flushes_after_writes_pause(tmp_path):
    import time

    s = Store(str(tmp_path / "f"), 10**7, LRUPolicy(), Counters())
    try:
        s.put_many([(k, b"f" * 100) for k in ids(5, seed=10)])
        deadline = time.monotonic() + 10
        while s.counters["flushes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.counters["flushes"] == 1 and s._dirty_state()[0] is None
        time.sleep(0.3)
        assert s.counters["flushes"] == 1  # nothing new: no more flushes
    finally:
        s.close()


def test_a_data_dir_holds_one_store_at_a_time(tmp_path):
    from cacheserver.store import DataDirBusy
    from clients.embedded import EmbeddedCache, EmbeddedCacheBusy

    s = Store(str(tmp_path / "d"), 10 << 20, LRUPolicy(), Counters())
    with pytest.raises(DataDirBusy, match="is in use by another cache server"):
        Store(str(tmp_path / "d"), 10 << 20, LRUPolicy(), Counters())
    with pytest.raises(EmbeddedCacheBusy, match="pass cache_dir= to use another"):
        EmbeddedCache(str(tmp_path / "d"), 10 << 20)
    s.close()
    Store(str(tmp_path / "d"), 10 << 20, LRUPolicy(), Counters()).close()  # released on close


def test_large_values_are_in_blob_files_a_follower_never_reads(tmp_path):
    """Values of diskbudget.BLOB_MIN bytes and up go to blob files, in a column family that
    same-host followers do not open (a RocksDB secondary crashes reading a blob): the server
    answers them inline, and a follower that reads ahead finds them absent, never crashes."""
    import glob

    from cacheserver.client.localread import LocalReader
    from cacheserver.core import CacheCore
    from cacheserver.diskbudget import BLOB_MIN

    s = Store(str(tmp_path / "st"), 1 << 30, make_policy("lru"), Counters())
    try:
        small, large = ids(2, seed=3), ids(2, seed=4)
        values = {k: os.urandom(1000) for k in small} | {k: os.urandom(BLOB_MIN) for k in large}
        s.put_many(list(values.items()))
        s.flush()
        keys = [small[0], large[0], small[1], large[1]]
        assert s.touch_split(keys) == (b"\x01" * 4, [1, 3])
        assert glob.glob(os.path.join(s.db_path, "*.blob")) and s.blob_bytes == 2 * (BLOB_MIN + OVERHEAD)
        assert [bytes(v) for v in s.get_many(keys)] == [values[k] for k in keys]
        inline = CacheCore(s, s.counters).get_local_inline("j", keys)
        assert inline[0] is True and inline[2] is True and [bytes(inline[i]) for i in (1, 3)] == [values[k] for k in large]
        reader = LocalReader(s.db_path)
        try:
            got = reader.read(keys)
        finally:
            reader.close()
        assert [None if v is None else bytes(v) for v in got] == [values[small[0]], None, values[small[1]], None]
    finally:
        s.close()


def test_a_same_host_get_cut_for_its_size_is_counted(tmp_path):
    """Values only in the memtable go inline in a same-host get, bounded by --max-batch-size;
    those past it are answered as misses. Before: counted as misses only, not get_cut_for_size
    (an operator saw no cuts where a get over the socket counted them)."""
    from cacheserver.core import CacheCore, Limits

    s = Store(str(tmp_path / "st"), 1 << 30, make_policy("lru"), Counters())
    try:
        keys = ids(8, seed=5)
        s.put_many([(k, os.urandom(300_000)) for k in keys])  # not flushed: inline
        core = CacheCore(s, s.counters, Limits(max_batch_bytes=1_000_000))
        got = core.get_local_inline("j", keys)
        cut = sum(1 for v in got if v is None)
        assert cut == 5 and s.counters.snapshot()["get_cut_for_size"] == cut
    finally:
        s.close()
