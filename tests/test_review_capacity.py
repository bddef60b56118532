"""Review of the store's capacity accounting, eviction and disk admission (real stores on tmp dirs)."""
import os
import shutil

from cacheserver.client.server_client import ServerClient
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store
from procs import cacheserver


def _ballast(path: str, leave: int) -> None:
    """Fill the file system of ``path`` until ``leave`` bytes are free (tmpfs: writes allocate)."""
    free = shutil.disk_usage(os.path.dirname(path)).free
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_reserve_given_up_for_a_flush_comes_back_with_room(small_fs):
    """A flush that found the disk nearly full released the reserve (diskroom.before_flush); once
    room was back without puts having been refused, it was never made again, so the next time
    something else filled the disk a flush failed and the store stayed read-only until restart."""
    s = Store(str(small_fs / "d"), 40 << 20, LRUPolicy(), Counters())
    try:
        assert os.path.exists(s.room.reserve_path)
        for _ in range(2):  # twice: the reserve must be there for the second fill too
            s.put_many([(os.urandom(32), os.urandom(200_000)) for _ in range(4)])
            _ballast(str(small_fs / "ballast"), s._unflushed_bytes() // 2 + (1 << 20))
            s.flush()  # fits only by giving the reserve up
            assert s.room.state == "ok" and not os.path.exists(s.room.reserve_path)
            os.unlink(small_fs / "ballast")
            assert s.put_many([(os.urandom(32), os.urandom(1000)) for _ in range(4)]) == (4, 0, 0)
            assert os.path.exists(s.room.reserve_path), "the reserve stayed gone after room was back"
        s.put_many([(os.urandom(32), os.urandom(200_000)) for _ in range(4)])
        _ballast(str(small_fs / "ballast"), 256 << 10)  # someone else fills the disk
        s.flush()
        assert s.room.state == "ok", s.room._why  # was "failed": RocksDB read-only until restart
        os.unlink(small_fs / "ballast")
        assert s.put_many([(os.urandom(32), os.urandom(1000))]) == (1, 0, 0)
    finally:
        s.close()


def test_restart_with_lower_capacity_keeps_the_active_and_referenced_chunk(tmp_path):
    """A server restarted with a lower --capacity evicted at recovery, before its chunk table
    was loaded: the oldest entries went, those of the active chunk a job referenced included,
    while untagged ones stayed."""
    data = str(tmp_path / "s")
    chunk = [(os.urandom(32), os.urandom(1000)) for _ in range(300)]
    other = [(os.urandom(32), os.urandom(1000)) for _ in range(700)]
    d = cacheserver(data, "4MB").start()
    try:
        with ServerClient(d.address) as c:
            assert c.put(chunk, dataset="ds", chunk=0)[0] == 300  # the oldest entries
            assert c.put(other)[0] == 700
            c.active_chunk("ds", 0)
            assert c.ref_chunk("ds", 0, "job-a") == 1
    finally:
        assert d.stop() == 0
    d = cacheserver(data, "1MB").start()  # 1,000 entries of 1,128 bytes charged: over by 128 KB
    try:
        with ServerClient(d.address) as c:
            st = c.stats()
            assert st.counters["evicted_items"] > 0
            assert c.lookup([k for k, _ in chunk]) == b"\x01" * 300, "the referenced chunk was evicted"
            assert c.lookup([k for k, _ in other]).count(0) == st.counters["evicted_items"]
    finally:
        assert d.stop() == 0


def test_ids_held_already_do_not_count_against_the_disk_room(small_fs):
    """The file-system check charged a put for every id in it, held ones too, which are not
    written again: near a full disk a put of jobs' shared misses, mostly held already, had its
    one new item refused (rejected_disk_full) and the store logged "disk full" with room left."""
    s = Store(str(small_fs / "d"), 40 << 20, LRUPolicy(), Counters())
    try:
        held = [(os.urandom(32), os.urandom(100_000)) for _ in range(20)]
        assert s.put_many(held) == (20, 0, 0)
        s.flush()
        _ballast(str(small_fs / "ballast"), (1 << 20) + (500 << 10))  # room for a small put, not 2 MB
        assert s.put_many(held + [(os.urandom(32), os.urandom(1000))]) == (1, 20, 0)
        assert s.room.state == "ok" and s.counters["rejected_disk_full"] == 0
        os.unlink(small_fs / "ballast")
    finally:
        s.close()


def test_restart_with_lower_capacity_evicts_protected_entries_last(tmp_path):
    """Protected chunks go last at recovery, yet the store still ends within its capacity."""
    from cacheserver.core import CacheCore
    from cacheserver.store import OVERHEAD

    path = str(tmp_path / "s")
    s = Store(path, 10**7, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters)
    chunk = [(os.urandom(32), os.urandom(1000)) for _ in range(20)]
    other = [(os.urandom(32), os.urandom(1000)) for _ in range(10)]
    s.put_many(chunk, ("ds", 0))
    s.put_many(other)
    core.chunks.set_active("ds", 0)
    s.close()
    s = Store(path, 15 * (1000 + OVERHEAD), LRUPolicy(), Counters())  # less than the chunk alone
    try:
        assert s.used <= s.capacity and s.items == 15
        assert s.contains([k for k, _ in other]) == bytes(10)  # the unprotected went first
        assert s.usage_by_tag()[("ds", 0)].items == 15
    finally:
        s.close()
