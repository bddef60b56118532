"""The loader statistics' rows in shared memory (clients/stats.py): no two processes ever
add to one row, so nothing is lost; a worker past the rows is refused."""
import multiprocessing

import pytest

from clients.stats import MAX_ROWS, MAX_WORKERS, SharedCounters, SharedRows

ADDS = 100_000


def _add(counters: SharedCounters, row: int, start) -> None:
    start.wait(60)
    for _ in range(ADDS):
        counters.add(row, hits=1, store_bytes=3)


@pytest.mark.parametrize("rows", [
    (1, 130),                       # worker 0 and worker 129: one row once (rows were modulo 129)
    (MAX_ROWS - 2, MAX_ROWS - 1),   # the last two workers
])
def test_processes_adding_at_once_lose_nothing(rows):
    ctx = multiprocessing.get_context("spawn")
    counters, start = SharedCounters(), ctx.Event()
    procs = [ctx.Process(target=_add, args=(counters, r, start)) for r in rows]
    for p in procs:
        p.start()
    start.set()  # together: their adds interleave
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    totals = counters.totals()
    assert (totals["hits"], totals["store_bytes"]) == (2 * ADDS, 6 * ADDS)


def test_rows_are_summed_and_a_worker_past_them_is_refused():
    c = SharedRows(2)
    c.add(0, {0: 1})
    c.add(MAX_ROWS - 1, {1: 2})
    c.add(130, {0: 10})
    c.add(2, {1: 1000})
    assert c.sums() == [11, 1002]
    assert c._arr[2 * 2 + 1] == 1000 and c._arr[2 * 2] == 0 and c._arr[130 * 2] == 10
    with pytest.raises(ValueError, match=f"rows for {MAX_WORKERS} DataLoader workers; worker {MAX_WORKERS} is past"):
        c.add(MAX_ROWS, {0: 1})
    assert c.sums() == [11, 1002]
