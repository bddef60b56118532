"""Chunked double buffering with k == 2: the chunk evicted and the chunk loading next are
the same one, decided by one event. The EvictChunk used to go out to the servers after the
clients had the plan that says "load chunk 0", so it deleted their puts of chunk 0.

The allocation no longer makes k == 2 chunked plans (two chunks of a two-item dataset cost
the whole of it: FULL), but a state journaled before that still holds one; the actuator
sends no EvictChunk of a chunk resident in the state again (test_review_evictions.py has
the general case: a queue a whole pass behind)."""
from cacheserver.client.server_client import ServerClient
from manager.actuator import Actuator, Desired
from manager.effects import EvictChunk
from manager.model import ManagerModel
from manager.policy import DoubleBuffer, chunk_members

DS = "d4" * 32
N = 2  # two items, two chunks


def _held(sc):
    return {c.chunk: c.items for c in sc.stats().chunks if c.dataset == DS}


def test_an_eviction_decided_with_the_reload_of_its_chunk_spares_the_reload(server):
    buf, _ = DoubleBuffer.create(DS, N, 2, 0.0)
    buf.attach("job-a", 1.0)
    buf.loaded(0, 1.0, 2.0)
    buf.release("job-a", 0, 3.0)
    # Chunk 1 loaded: it becomes active, chunk 0 (marked, nobody on it) goes, and starts
    # loading again at once.
    effects = ManagerModel().effects_of_actions(buf.loaded(1, 1.0, 4.0))
    assert EvictChunk(DS, 0, False, "all jobs released it") in effects
    assert (buf.active, buf.loading) == (1, 0)
    want = Desired(option={DS: "chunked"}, resident={DS: set(buf.resident())}, active={DS: 1})
    act = Actuator(lambda: want, lambda: [server.address], timeout=2.0)
    keys = [bytes([i + 1]) * 32 for i in range(N)]
    try:
        with ServerClient(server.address, use_dataplane=False) as sc:
            for c in (0, 1):
                sc.put([(keys[i], b"v" * 100) for r in chunk_members(c, N, 2) for i in r], dataset=DS, chunk=c)
            act.submit(effects)  # the clients had the plan, and put chunk 0, before the calls went out
            assert act.drain(5)
            assert _held(sc) == {0: 1, 1: 1}, "the puts of the reloading chunk 0 were deleted"
            assert sc.active_chunk(DS) == 1
            want.resident = {DS: {1}}  # once it is not resident, an eviction of it goes out
            act.submit([EvictChunk(DS, 0, False, "all jobs released it")])
            assert act.drain(5)
            assert _held(sc) == {1: 1}
    finally:
        act.stop()
