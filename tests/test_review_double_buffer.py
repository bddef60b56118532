"""Chunked double buffering with k == 2: the chunk evicted and the chunk loading next are
the same one, decided by one event. The EvictChunk used to go out to the servers after the
clients had the plan that says "load chunk 0", so it deleted their puts of chunk 0."""
import time

from cacheserver.client.server_client import ServerClient
from manager.manager_client import ManagerClient
from manager.model import ManagerModel
from manager.effects import EvictChunk
from manager.policy import chunk_members
from procs import cachemanager, cacheserver, wait_until

DS = "d4" * 32
N = 2  # two items: k = min(10, n_items) = 2 chunks




def _held(sc):
    return {c.chunk: c.items for c in sc.stats().chunks if c.dataset == DS}


def test_reloaded_chunk_keeps_the_puts_made_after_the_plan_said_load_it(tmp_path):
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--bypass-probes",
                     "--budget", "300kB", "--chunk-size", "100kB").start()
    try:
        s = cacheserver(str(tmp_path / "s1"), "64MB", 0, "--manager", m.address,
                        "--data-listen", "127.0.0.1:0").start()
    except BaseException:
        m.kill()
        raise
    keys = [bytes([i + 1]) * 32 for i in range(N)]
    try:
        with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
            wait_until(lambda: len(mc.get_ring().addresses) == 1, what="server registered")
            plan = mc.register_job("job-a", DS, 1_000_000, N).plan
            assert plan.option == "chunked" and plan.k == 2

            def put(c):
                sc.put([(keys[i], b"v" * 100) for r in chunk_members(c, N, 2) for i in r], dataset=DS, chunk=c)

            put(0)
            assert mc.report_loaded(DS, 0, 1.0).loading == 1
            put(1)
            assert mc.release_chunk("job-a", DS, 0).chunks == (1,)
            # Chunk 1 loaded: it becomes active, chunk 0 (marked, nobody on it) goes, and
            # starts loading again at once. The client loads what the plan says.
            p = mc.report_loaded(DS, 1, 1.0)
            assert (p.active, p.loading) == (1, 0)
            put(0)
            wait_until(lambda: sc.active_chunk(DS) == 1, what="ActiveChunk(1) on the server")
            time.sleep(1.0)  # the calls decided with it have landed by now
            assert _held(sc).get(0) == 1, "the puts of the reloading chunk 0 were deleted"
            # A whole turn later the active chunk 0 still has its items (hits, not misses).
            assert mc.release_chunk("job-a", DS, 1).chunks == (0,)
            p = mc.report_loaded(DS, 0, 1.0)
            assert (p.active, p.loading) == (0, 1)
            wait_until(lambda: sc.active_chunk(DS) == 0, what="ActiveChunk(0) on the server")
            time.sleep(0.5)
            assert all(v is not None for v in sc.get([keys[i] for r in chunk_members(0, N, 2) for i in r]))
    finally:
        s.kill()
        m.kill()


def _register(m, job, n_items, now):
    return m.apply({"type": "job_register", "job": job, "dataset": DS, "dataset_bytes": 1_000_000,
                    "n_items": n_items, "n_gpus": 1, "token_hash": "", "now": now})


def _model():
    m = ManagerModel()
    m.apply({"type": "configure", "now": 0.0, "config": {
        "budget": 300_000, "alloc": {"chunk_bytes": 100_000, "mechanism": "chunks"}}})
    return m


def test_model_sends_no_eviction_of_a_chunk_that_reloads_at_once_but_does_otherwise():
    for n_items, expect_evict in ((2, False), (100, True)):
        m = _model()
        _register(m, "job-a", n_items, 1.0)
        buf = m.buffers[DS]
        effects = m.apply({"type": "loaded", "dataset": DS, "chunk": 0, "fraction": 1.0, "now": 2.0})
        effects += m.apply({"type": "release", "job": "job-a", "dataset": DS, "chunk": 0, "now": 3.0})
        effects += m.apply({"type": "loaded", "dataset": DS, "chunk": 1, "fraction": 1.0, "now": 4.0})
        assert buf.marked is None and buf.active == 1  # chunk 0 left the MARKED state
        evicts = [e for e in effects if isinstance(e, EvictChunk)]
        assert bool(evicts) == expect_evict, (n_items, effects)
        assert buf.loading == (0 if n_items == 2 else 2)
