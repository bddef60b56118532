"""SharedPlan (clients/coordination.py), the plan DataLoader workers read from shared
memory: a defect found in review, reproduced with a real reader process. Readers read the
chunking of one plan and the chunk list of the next one while the coordinator published it
(no seqlock): items were inserted under chunks they are not in (and, mid-write, every item
under chunk 0). The manager's side of that review (EvictDatasets owed while queued, a
re-plan at start) is tested in tests/test_review_manager_service.py."""
from __future__ import annotations

import multiprocessing
import time

from clients.coordination import SPARE, SharedPlan
from manager.manager_client import Plan, chunk_of


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
