"""The manager's path from decisions to servers and clients (manager/actuator.py,
manager/evictledger.py, manager/state.py, clients/coordination.py): defects found in
review, reproduced with real cachemanager and cacheserver processes on loopback (kill -9
for restarts) or, for the shared plan, real processes reading shared memory.

1. An EvictDataset queued for a server (its calls lag, or wait out --server-timeout) was
   owed only once its call failed: a manager killed (kill -9) before that forgot it, and
   the re-planned dataset's old entries stayed pinned on the server under the new plan's
   chunk numbers.
2. A re-plan decided as the manager starts (its flags changed: a configure event) reached
   no server out of the ring then: the actuator learnt the addresses the state knows only
   after the state was opened, so the EvictDataset was owed to none of them.
3. SharedPlan readers (DataLoader workers) read the chunking of one plan and the chunk
   list of the next one while the coordinator published it (no seqlock): items were
   inserted under chunks they are not in (and, mid-write, every item under chunk 0)."""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

from cacheserver.client.server_client import ServerClient
from clients.coordination import SPARE, SharedPlan
from manager.manager_client import ManagerClient, Plan, chunk_of
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until

A, B = "a1" * 16, "b2" * 16
CHUNKS = ("--chunks", "--chunk-size", "100kB")


def _keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def _full_dataset_on(mc: ManagerClient, sc: ServerClient, keys: list[bytes]) -> None:
    """Job j1 on A (200 kB): FULL; its entries (chunk 0, active: pinned) on the server."""
    assert mc.register_job("j1", A, 200_000, 20).plan.option == "full"
    sc.put([(k, b"v" * 10_000) for k in keys], dataset=A, chunk=0)
    mc.report_loaded(A, 0, 1.0)
    wait_until(lambda: sc.stats().active_chunks.get(A) == 0, "the active chunk on the server")


def test_an_eviction_still_queued_when_the_manager_is_killed_reaches_the_server_after_its_restart(tmp_path):
    """The server does not answer (SIGSTOP) when a second job re-plans A FULL -> CHUNKED; the
    manager is killed while the EvictDataset waits for it. Before the fix the restarted
    manager owed it nothing: reconcile sees chunk 0 resident in the new plan too, and the
    whole old dataset stayed on the server pinned as chunk 0."""
    args = (*CHUNKS, "--budget", "300kB", "--heartbeat-misses", "100", "--server-timeout", "30")
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port, *args).start()
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
    keys = _keys(20, 1)
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc, ServerClient(s.address, use_dataplane=False) as sc:
            _full_dataset_on(mc, sc, keys)
            os.kill(s.pid, signal.SIGSTOP)
            try:
                mc.register_job("j2", B, 250_000, 25, n_gpus=8)
                assert mc.get_plan(A, "j1").option == "chunked"
                m.kill()  # its call to the server waits (30 s to fail)
                m = cachemanager(str(tmp_path / "m"), port, *args).start()
            finally:
                os.kill(s.pid, signal.SIGCONT)
            wait_until(lambda: sc.lookup(keys) == b"\0" * 20, "the old plan's entries evicted", 15)
        assert m.stop() == 0
    finally:
        s.kill()
        m.kill()


def test_a_re_plan_decided_as_the_manager_starts_reaches_a_server_out_of_the_ring_when_back(tmp_path):
    """The server left the ring (it stopped answering heartbeats); the manager restarts with a
    smaller --budget, which re-plans A FULL -> CHUNKED as it opens its state. The server
    comes back: before the fix it got no EvictDataset, and A's old entries stayed pinned."""
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port, *CHUNKS, "--budget", "300kB").start()
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
    keys = _keys(20, 2)
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc, ServerClient(s.address, use_dataplane=False) as sc:
            _full_dataset_on(mc, sc, keys)
            os.kill(s.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: not mc.get_ring().addresses, "the server to leave the ring")
                assert m.stop() == 0
                m = cachemanager(str(tmp_path / "m"), port, *CHUNKS, "--budget", "100kB").start()
                assert mc.get_plan(A, "j1").option == "chunked"
            finally:
                os.kill(s.pid, signal.SIGCONT)
            wait_ring(m.address, 1)
            wait_until(lambda: sc.lookup(keys) == b"\0" * 20, "the old plan's entries evicted", 15)
    finally:
        s.kill()
        m.kill()


# Two plans of one dataset: item I is outside the chunks of each (SPARE), while either
# plan's chunking with the other's chunk list puts it in a chunk.
N = 100
PLAN_A = Plan("d", "chunked", 4, N, 25, 1, None, (1,), 5)
PLAN_B = Plan("d", "chunked", 2, N, 50, 0, None, (0,), 6)
I = next(i for i in range(N) if (chunk_of(i, N, 4), chunk_of(i, N, 2)) == (0, 1))


def _read_plans(plan: SharedPlan, started, stop, q) -> None:
    got: dict = {}
    started.set()
    deadline = time.monotonic() + 20
    while not stop.is_set() and time.monotonic() < deadline:
        r = plan.insert_chunk(I)
        got[r] = got.get(r, 0) + 1
    q.put(got)


def test_a_worker_never_reads_a_plan_half_published():
    sp = SharedPlan()
    sp.publish(PLAN_A)
    assert sp.insert_chunk(I) == SPARE
    ctx = multiprocessing.get_context("spawn")
    q, started, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=_read_plans, args=(sp, started, stop, q))
    p.start()
    try:
        assert started.wait(30)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            sp.publish(PLAN_B)
            sp.publish(PLAN_A)
        stop.set()
        got = q.get(timeout=30)
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()
    assert set(got) == {SPARE}, got  # before the fix: chunk 0 and chunk 1 too
    assert sp.insert_chunk(I) == SPARE
