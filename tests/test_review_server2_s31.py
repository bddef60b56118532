"""Review of the store's paths that held its lock while they waited out a write stop (up to
STUCK_S), so that every put, adopt and eviction (the manager's too) waited for that lock meanwhile:

* a flush's deletes of stranded ids (Flushes._drop_stranded) when the stop began after the flush's
  stuck check;
* a retag: an adopt, or a put under a chunk of ids held as spare entries (Store._retag);
* a put's evictions (evict_for, also from diskadmit.make_room), the delete of a replaced record a
  put found no room for (_drop_replaced), and the rewrite of the oldest blob values
  (relocate_oldest).

Each now tries once under the lock: what a stop refuses is left for later (a stranded delete, done
by the first flush once writes go; a retag or a relocation not made). Gets, which take no store
lock, answer throughout; the tests time them too. Writes are stopped for real, as
test_review_write_stop.py does (level 0 past its stop trigger, no compaction due); the tests only
choose when the stop begins."""
import os
import threading
import time

import pytest

import test_review_server_s31 as s31
from cacheserver.client.server_client import ServerClient
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store
from test_review_store2_s29 import every_record_counted
from test_review_store_failures import SLOT, assert_counted, stopped_full_store
from test_review_store_order_writes import accounting, large_store, tag_on_disk
from test_review_store_s29 import level0_files
from test_review_write_stop import GO, STOP, stop_writes

server, slow_give_up = s31.server, s31.slow_give_up  # a real server; STUCK_S = GIVE_UP_S
GIVE_UP_S = s31.GIVE_UP_S
SMALL = 1000
AT_ONCE_S = 1.0  # a call that waits for no stop answers within this (a stop's wait is GIVE_UP_S)
SPARE, CHUNK = ("ds", -1), ("ds", 1)


def meanwhile(holder, probes: dict) -> tuple[float, object, dict[str, tuple[float, object]]]:
    """Run ``holder`` in a thread; once it is under way (inside the stop), time each probe.
    Returns (the holder's time, its result or exception, probe name -> (time, result))."""
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            r = holder()
        except Exception as e:
            r = e
        out.append((time.monotonic() - t0, r))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.3)
    took = {name: s31.timed(caught, fn) for name, fn in probes.items()}
    th.join(GIVE_UP_S * 3)
    assert out, "the holder never ended"
    return out[0][0], out[0][1], took


def caught(fn):
    """fn's result, or the exception it raised (a probe's time is what is asked of it)."""
    try:
        return fn()
    except Exception as e:
        return e


def answered_at_once(took: dict) -> None:
    slow = {name: round(t, 1) for name, (t, _) in took.items() if t >= AT_ONCE_S}
    assert not slow, f"waited for the store's lock through a write stop (s): {slow}"


def test_a_flush_whose_stranded_deletes_meet_a_stop_holds_no_lock_through_it(server):
    s = server.store
    c = ServerClient(server.address, timeout=10.0)
    try:
        gone = [(os.urandom(32), os.urandom(SMALL)) for _ in range(3)]
        kept, spare = (os.urandom(32), os.urandom(SMALL)), (os.urandom(32), os.urandom(SMALL))
        assert c.put(gone, dataset="ds", chunk=0) == (3, 0, 0)
        assert c.put([kept], dataset="other", chunk=0) == (1, 0, 0)
        assert c.put([spare], dataset=SPARE[0], chunk=SPARE[1]) == (1, 0, 0)
        level0_files(s, 4)
        s._db.set_options(STOP)
        s.evict_tags(lambda t: t == ("ds", 0))  # the manager's: its deletes stranded
        keys = [k for k, _ in gone]
        assert set(s._stranded) >= set(keys)
        s._db.set_options(GO)
        real = s._drop_stranded

        def stop_begins():  # after the flush's stuck check: writes went then
            s._db.set_options(STOP)
            return real()
        s._drop_stranded = stop_begins
        took, flushed, probes = meanwhile(s.flush, {"get": lambda: c.get([kept[0]]),
                                                    "adopt": lambda: c.adopt([spare[0]], "job", *CHUNK),
                                                    "evict": lambda: s.evict_tags(lambda t: t == ("none", 0))})
        answered_at_once(probes)
        assert took < AT_ONCE_S and flushed is False, (took, flushed)
        assert [bytes(v) for v in probes["get"][1]] == [kept[1]]
        assert probes["adopt"][1] == b"\x00"  # its retag refused too: still spare, answered as absent
        assert set(s._stranded) >= set(keys) and not s31.gone_from_disk(s, keys)  # kept for later, not lost
        assert s._dirty_since is not None  # the flusher comes back for them
        del s._drop_stranded
        s._db.set_options(GO)
        assert s.flush() and not s._stranded and s31.gone_from_disk(s, keys)
        assert s.get_many(keys) == [None] * 3 and [bytes(v) for v in s.get_many([kept[0]])] == [kept[1]]
        assert c.adopt([spare[0]], "job", *CHUNK) == b"\x01" and tag_on_disk(s, spare[0]) == CHUNK
    finally:
        c.close()


@pytest.mark.parametrize("via", ["adopt", "put"])
def test_a_retag_during_a_write_stop_answers_at_once_and_moves_nothing(server, via):
    s = server.store
    c = ServerClient(server.address, timeout=10.0)
    try:
        items = [(os.urandom(32), os.urandom(SMALL)) for _ in range(3)]
        kept = (os.urandom(32), os.urandom(SMALL))
        assert c.put(items, dataset=SPARE[0], chunk=SPARE[1]) == (3, 0, 0)
        assert c.put([kept], dataset="other", chunk=0) == (1, 0, 0)
        level0_files(s, 4)
        s._db.set_options(STOP)
        keys = [k for k, _ in items]
        before = s.usage_by_tag()
        retag = ((lambda: c.adopt(keys, "job", *CHUNK)) if via == "adopt"
                 else (lambda: c.put(items, dataset=CHUNK[0], chunk=CHUNK[1])))
        took, answer, probes = meanwhile(retag, {"get": lambda: c.get([kept[0]]),
                                                 "evict": lambda: s.evict_tags(lambda t: t == ("none", 0))})
        answered_at_once(probes)
        assert took < AT_ONCE_S, f"the {via} waited {took:.1f} s for the write stop ({answer!r})"
        assert answer == (b"\x00" * 3 if via == "adopt" else (0, 3, 0))  # held still, as spare entries
        assert [tag_on_disk(s, k) for k in keys] == [SPARE] * 3 and s.usage_by_tag() == before
        assert s.contains(keys, not_spare=True) == bytes(3) and s.contains(keys) == b"\x01" * 3
        s._db.set_options(GO)
        assert c.adopt(keys, "job", *CHUNK) == b"\x01" * 3  # once writes go it moves
        assert [tag_on_disk(s, k) for k in keys] == [CHUNK] * 3
        assert s.counters["adopted"] == 3 and s.counters["put_retagged"] == 0  # counted once, when made
    finally:
        c.close()


@pytest.mark.parametrize("how", ["evict", "replace-too-large"])
def test_a_put_s_deletes_under_the_lock_wait_out_no_stop(tmp_path, slow_give_up, how):
    """A put into a full store evicts one entry, or replaces an id with a value past the capacity
    (its old, poisoned record deleted): both deleted under the store's lock."""
    path = str(tmp_path / "s")
    s, keys = stopped_full_store(path)
    try:
        if how == "evict":
            put = lambda: s.put_many([(os.urandom(32), b"n" * SMALL)])  # noqa: E731
        else:
            put = lambda: s.put_many([(keys[0], b"n" * (9 * SLOT))], replace=True)  # noqa: E731
        took, answer, probes = meanwhile(put, {"get": lambda: s.get_many(keys[1:]),
                                               "held": lambda: s.held(keys),
                                               "evict": lambda: s.evict_tags(lambda t: t == ("none", 0))})
        answered_at_once(probes)
        victims = [k for k in keys if k not in s._index]
        assert len(victims) == 1 and set(s._stranded) >= set(victims)  # a miss at once, deleted later
        assert all(v is None for v in s.get_many(victims))
        if how == "replace-too-large":  # nothing else of it waits: answered at once, refused for size
            assert took < AT_ONCE_S and answer == (0, 0, 1) and victims == keys[:1], (took, answer)
        s._db.set_options(GO)
        assert s.flush() and not s._stranded
        assert_counted(s)
        every_record_counted(s)
    finally:
        s.close()
    again = Store(path, 8 * SLOT, LRUPolicy(), Counters())
    try:
        assert victims[0] not in again._index
        assert_counted(again)
        every_record_counted(again)
    finally:
        again.close()


def test_relocating_old_blob_values_during_a_stop_answers_at_once_and_moves_nothing(tmp_path, slow_give_up):
    s, keys = large_store(str(tmp_path / "s"), "cache")
    try:
        stop_writes(s)
        before = accounting(s)
        took, moved, probes = meanwhile(lambda: s.relocate_oldest(1 << 30),
                                        {"get": lambda: s.get_many(keys), "held": lambda: s.held(keys)})
        answered_at_once(probes)
        assert took < AT_ONCE_S and moved == 0, (took, moved)
        assert accounting(s) == before
        s._db.set_options(GO)
        assert s.relocate_oldest(1) > 0  # once writes go it moves
        assert_counted(s)
    finally:
        s.close()


def test_deletes_a_stop_left_go_with_the_next_put_without_a_flusher(tmp_path, slow_give_up):
    """Durability "process" runs no flusher: a put's evictions a stop refused were left on disk,
    uncounted, until some flush; the next put that writes (so writes go) deletes them."""
    path = str(tmp_path / "s")
    s, keys = stopped_full_store(path, "process")
    try:
        assert s._flusher is None
        with pytest.raises(Exception, match="stopped"):  # its own write gives up on the stop
            s.put_many([(os.urandom(32), b"n" * SMALL)])
        victims = [k for k in keys if k not in s._index]
        assert len(victims) == 1 and set(s._stranded) >= set(victims)
        s._db.set_options(GO)
        assert s.put_many([(os.urandom(32), b"m" * SMALL)]) == (1, 0, 0)
        assert not s._stranded and s31.gone_from_disk(s, victims)
        assert_counted(s)
        every_record_counted(s)
    finally:
        s.close()
