"""Review of a store's start during a write stop (cacheserver/storerecovery.py, store.py,
storeflush.py, chunkrefs.py, core.py): what the stop keeps off the disk at start is owed, and
paid once writes go again, without degrading the store until a restart.

* A corrupt saved chunk table: the store's recovery and then CacheCore each tried to save the
  emptied table, each waiting out the stop (STUCK_S: 10 s, so a server took 20 s or more to
  start, past the readiness bound of its supervisor), each warning; the repair was never
  written once writes went, so every later start dropped the table again.
* An owed durable mark was written by the first put even after a flush had written a newer
  one: the mark went back, and the next start checked again every value written since.
* Chunks the table protects, held past a capacity lowered while a start met a stop, stayed past
  it until a restart: puts evict no protected chunk, so every put found the store full.
* Past the start, too: a chunk call (active chunk, reference) during a stop waited it out and
  answered an error, though the table in memory had changed and protected the chunk; now it is
  answered and the table written once writes go. Evictions a stop cut short (their ids out of
  the index, deleted once writes go) were not counted.

Writes are stopped for real, as test_review_write_stop.py does (stopping_at_open: level 0 past
its stop trigger as the store opens, nothing RocksDB does ends the stop)."""
import json
import logging
import os

import pytest

from cacheserver import stallwrite
from cacheserver.chunkrefs import STATE_KEY
from cacheserver.client.server_client import ServerClient
from cacheserver.core import CacheCore
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.server import SERVER_ID_KEY, CacheServer, ServerConfig
from cacheserver.store import OVERHEAD, Store
from test_review_store_failures import assert_counted, dropped_warnings, ids, stopped_full_store
from test_review_store_order_writes import stopping_at_open
from test_review_write_stop import GO, durable_mark, stop_writes

SLOT = 1000 + OVERHEAD


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


@pytest.fixture
def give_ups(monkeypatch) -> list[str]:
    """Every write that waited out the stop and gave up on it (stallwrite.Progress.give_up)."""
    seen: list[str] = []
    real = stallwrite.Progress.give_up

    def give_up(self, why):
        seen.append(why)
        return real(self, why)
    monkeypatch.setattr(stallwrite.Progress, "give_up", give_up)
    return seen


def saved_table(path: str) -> bytes | None:
    s = Store(path, 64 << 20, LRUPolicy(), Counters())
    try:
        return s._server.get(STATE_KEY.encode())
    finally:
        s.close()


def test_a_chunk_table_repaired_during_a_stop_is_kept_and_written_once_writes_go(tmp_path, monkeypatch,
                                                                                 caplog, give_ups):
    data = str(tmp_path / "d")
    s = Store(data, 64 << 20, LRUPolicy(), Counters())
    keys = ids(4)
    assert s.put_many([(k, b"x" * 2000) for k in keys], ("ds", 0)) == (4, 0, 0)
    s.put_state(STATE_KEY, b'{"active": {"ds": 0}, "refs": [["ds", 0, ')  # cut short
    s.put_state(SERVER_ID_KEY, b"a-server-started-here-before")
    stop_writes(s)
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    caplog.set_level(logging.WARNING, logger="cacheserver")
    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=data, capacity=64 << 20))
    srv.start()
    try:
        # one write waited out the stop: the recovery's repair (the core's waited again, each as long)
        assert len(give_ups) == 1, give_ups
        assert len(dropped_warnings(caplog)) == 1, dropped_warnings(caplog)
        assert not [r for r in caplog.records if "could not save the emptied chunk table" in r.getMessage()]
        with ServerClient(srv.address) as c:
            assert [bytes(v) for v in c.get(keys)] == [b"x" * 2000] * 4
            assert dict(c.stats().active_chunks) == {}
            srv.store._db.set_options(GO)
            assert c.put([(os.urandom(32), b"n" * 1000)])[0] == 1  # the first put writes the repair
    finally:
        srv.stop(grace=0)
    assert json.loads(saved_table(data)) == {"active": {}, "refs": []}  # was the corrupt table still
    caplog.clear()
    again = Store(data, 64 << 20, LRUPolicy(), Counters())
    try:
        CacheCore(again, again.counters)
        assert not dropped_warnings(caplog)  # a later start dropped it again
    finally:
        again.close()


def test_a_chunk_table_set_during_the_stop_is_not_overwritten_by_the_owed_repair(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    s = Store(path, 64 << 20, LRUPolicy(), Counters())
    s.put_state(STATE_KEY, b"{not json")
    stop_writes(s)
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    s = Store(path, 64 << 20, LRUPolicy(), Counters())
    try:
        core = CacheCore(s, s.counters)
        s._db.set_options(GO)
        core.chunks.set_active("ds", 3)  # written: the repair is owed no more
        assert s.put_many([(os.urandom(32), b"n" * 1000)]) == (1, 0, 0)
        s.flush()
    finally:
        s.close()
    assert json.loads(saved_table(path)) == {"active": {"ds": 3}, "refs": []}


def test_a_flush_s_mark_is_not_set_back_by_the_mark_owed_from_start(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    keys, bad = ids(5), os.urandom(32)
    s.put_many([(k, b"k" * 1000) for k in keys])
    s._meta.put(bad, b"\x01")  # an index record cut short: its delete is stranded at start
    stop_writes(s)
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    try:
        assert s._mark_owed is not None
        s._db.set_options(GO)
        s.flush()  # the stranded delete goes in, and the mark of everything held
        flushed = durable_mark(s)
        assert flushed == s._seq
        assert s.put_many([(os.urandom(32), b"n" * 1000)]) == (1, 0, 0)
        assert durable_mark(s) == flushed  # was 0: the mark owed from start, written by the put
        s.close()
    except BaseException:
        s.close()
        raise
    again = Store(path, 1 << 30, LRUPolicy(), Counters())
    try:
        assert again.items == 10 and again.counters["recovered_unflushed_dropped"] == 0
    finally:
        again.close()


def test_protected_chunks_past_a_capacity_lowered_during_a_stop_go_once_writes_do(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters)
    chunk = ids(8)
    assert s.put_many([(k, b"c" * 1000) for k in chunk], ("ds", 1)) == (8, 0, 0)
    core.chunks.set_active("ds", 1)  # protected: puts never evict it
    stop_writes(s)  # 4 more, untagged
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    s = Store(path, 6 * SLOT, LRUPolicy(), Counters())  # 12 held, room for 6
    try:
        core = CacheCore(s, s.counters)
        # evicted at once, protected chunks last; the deletes wait for writes (test_review_server2_s31.py)
        assert s.used <= s.capacity and len(s._stranded) == 6
        s._db.set_options(GO)
        s.put_many([(os.urandom(32), b"n" * 1000)])
        assert s.used <= s.capacity, f"{s.used - s.capacity} bytes held past the capacity"
        s.flush()
        assert_counted(s)
        held = set(s._index)
    finally:
        s.close()
    again = Store(path, 6 * SLOT, LRUPolicy(), Counters())
    try:
        assert set(again._index) == held and again.used <= again.capacity
    finally:
        again.close()


def test_chunk_calls_during_a_stop_are_answered_and_written_once_writes_go(tmp_path, give_ups):
    data = str(tmp_path / "d")
    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=data, capacity=64 << 20))
    srv.start()
    try:
        with ServerClient(srv.address) as c:
            assert c.put([(k, b"x" * 2000) for k in ids(3)], dataset="ds", chunk=1)[0] == 3
            stop_writes(srv.store)
            assert c.active_chunk("ds", 1) == 1  # the table's write tried once, left owed
            assert c.ref_chunk("ds", 1, "job-a") == 1  # at once: no wait for the stop
            assert len(give_ups) == 0 and srv.core.chunks.is_protected(("ds", 1))
            srv.store._db.set_options(GO)
            assert c.put([(os.urandom(32), b"n" * 1000)])[0] == 1  # writes the table first
    finally:
        srv.stop(grace=0)
    assert json.loads(saved_table(data)) == {"active": {"ds": 1}, "refs": [["ds", 1, ["job-a"]]]}


def test_evictions_a_stop_cuts_short_are_counted(tmp_path):
    s, keys = stopped_full_store(str(tmp_path / "s"))
    try:
        with pytest.raises(stallwrite.WriteStopped):
            s.put_many([(os.urandom(32), b"n" * 1000)])  # evicts one for itself
        assert s.used == 7 * SLOT and s.counters["evicted_items"] == 1  # was 0: out of the index, uncounted
        assert s.counters["evicted_bytes"] == SLOT
        s.evict_tags(lambda tag: True)  # answers at once: the deletes are left for a flush
        assert s.items == 0 and s.counters["evicted_items"] == 8
        s._db.set_options(GO)
        s.flush()  # the deletes go in
        assert all(s._raw(k) is None for k in keys)
        assert_counted(s)
    finally:
        s.close()


def test_a_new_server_id_during_a_stop_is_kept_and_saved_once_writes_go(tmp_path, monkeypatch, give_ups):
    """Before: the new id's save waited out the stop once more (a start past its readiness
    bound), then was given up: each start during the stop took another id."""
    data = str(tmp_path / "d")
    s = Store(data, 64 << 20, LRUPolicy(), Counters())
    s._meta.put(os.urandom(32), b"\x01")  # an index record cut short: its delete waits at start
    stop_writes(s)
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=data, capacity=64 << 20))
    srv.start()
    try:
        assert len(give_ups) == 1, give_ups  # the recovery's delete; the id's save waited no more
        sid = srv.server_id
        with ServerClient(srv.address) as c:
            srv.store._db.set_options(GO)
            assert c.put([(os.urandom(32), b"n" * 1000)])[0] == 1  # the first put writes the id
    finally:
        srv.stop(grace=0)
    again = Store(data, 64 << 20, LRUPolicy(), Counters())
    try:
        assert again.get_state(SERVER_ID_KEY) == sid.encode()
    finally:
        again.close()
