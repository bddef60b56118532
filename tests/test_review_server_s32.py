"""Review of the server's write-stop leftovers (s32), with a real server and store:

* A put under a chunk of ids held as spare entries retags them (`put_retagged`); a write stop
  refuses the retag, the entries stay spare and the put answers them `put_already`: nothing said
  so. Such entries are now counted, `retag_stopped` (Stats counters, cachectl stats, metrics).
* The ids of a chunk the manager evicted during a write stop are misses at once, their deletes
  owed until writes go again; a restart before that indexed them again (counted, served), until
  the manager's next reconcile evicted them again. The owed deletes are now recorded in a file
  beside the store (owedeletes.py), and the restart deletes them; an id put again since is kept.

Writes are stopped for real, as test_review_write_stop.py does (level 0 past its stop trigger, no
compaction due); the tests only choose when the stop begins."""
import os

import test_review_server_s31 as s31
from cacheserver.client.server_client import ServerClient
from cacheserver.server import CacheServer, ServerConfig
from cacheserver.store import OVERHEAD
from test_review_store2_s29 import every_record_counted
from test_review_store_s29 import level0_files
from test_review_write_stop import GO, STOP

server, slow_give_up = s31.server, s31.slow_give_up  # a real server; STUCK_S = GIVE_UP_S
SMALL = 1000


def test_a_put_s_retag_a_write_stop_refused_is_counted(server):
    s = server.store
    c = ServerClient(server.address, timeout=10.0, use_dataplane=False)
    try:
        items = [(os.urandom(32), os.urandom(SMALL)) for _ in range(3)]
        assert c.put(items, dataset="ds", chunk=-1) == (3, 0, 0)  # spare entries
        level0_files(s, 4)
        s._db.set_options(STOP)
        assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
        assert c.put(items, dataset="ds", chunk=0) == (0, 3, 0)  # held, but still spare
        keys = [k for k, _ in items]
        assert s.contains(keys, not_spare=True) == bytes(3)
        counters = c.stats().counters
        assert (counters["retag_stopped"], counters["put_retagged"]) == (3, 0)
        s._db.set_options(GO)
        assert c.put(items, dataset="ds", chunk=0) == (0, 3, 0)  # once writes go it moves
        counters = c.stats().counters
        assert (counters["retag_stopped"], counters["put_retagged"]) == (3, 3)
        assert s.contains(keys, not_spare=True) == b"\x01" * 3
    finally:
        c.close()


# ---- ids evicted during a write stop, then a restart before writes went -------------------------
def _restart(srv: CacheServer) -> CacheServer:
    srv.stop(grace=0)  # during the stop: its last flush is skipped, the deletes still owed
    again = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=srv.cfg.data_dir, capacity=64 << 20))
    again.start()  # writes go again: RocksDB opens with the store's own level-0 limits
    return again


def test_a_chunk_evicted_during_a_write_stop_stays_evicted_across_a_restart(tmp_path, slow_give_up):
    server = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    server.start()
    server.store._flusher.stop()  # flushes only where the test makes them
    s, owed_file = server.store, os.path.join(server.cfg.data_dir, "owed-deletes")
    c = ServerClient(server.address, timeout=10.0, use_dataplane=False)
    chunk = [(os.urandom(32), os.urandom(SMALL)) for _ in range(5)]
    kept = [(os.urandom(32), os.urandom(SMALL)) for _ in range(2)]
    keys = [k for k, _ in chunk]
    try:
        assert c.put(chunk, dataset="ds", chunk=0) == (5, 0, 0)
        assert c.put(kept, dataset="other", chunk=0) == (2, 0, 0)
        level0_files(s, 4)
        s._db.set_options(STOP)
        assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
        assert c.evict_chunk("ds", 0, force=True) == (5, 5 * (SMALL + OVERHEAD))  # the manager's call
        assert set(s._stranded) == set(keys) and not s31.gone_from_disk(s, keys)
    except BaseException:
        server.stop(grace=0)
        raise
    finally:
        c.close()
    owed = open(owed_file, "rb").read() if os.path.exists(owed_file) else b""  # the deletes a restart owes
    again = _restart(server)  # stopped during the stop: the deletes still owed
    try:
        t = again.store
        assert t.contains(keys) == bytes(5), "ids evicted during the stop came back"
        assert s31.gone_from_disk(t, keys) and not os.path.getsize(owed_file)
        c = ServerClient(again.address, timeout=10.0, use_dataplane=False)
        assert ("ds", 0) not in {(ch.dataset, ch.chunk) for ch in c.stats().chunks}
        assert [bytes(v) for v in t.get_many([k for k, _ in kept])] == [v for _, v in kept]
        every_record_counted(t)
        back = keys[0], os.urandom(SMALL)  # one of them put again
        assert c.put([back], dataset="ds", chunk=1) == (1, 0, 0)
        c.close()
    finally:
        again.stop(grace=0)
    with open(owed_file, "wb") as f:  # records of deletes done since (an emptying that failed)
        f.write(owed)
    third = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=server.cfg.data_dir, capacity=64 << 20))
    third.start()
    try:  # they delete nothing put since
        assert [bytes(v) if v is not None else None for v in third.store.get_many(keys)] == [back[1]] + [None] * 4
        every_record_counted(third.store)
    finally:
        third.stop(grace=0)
