"""The loader statistics' rows in shared memory (clients/stats.py): no two processes ever
add to one row unlocked, so nothing is lost, however many workers a loader has: rows
past the table's go to one overflow row, which its processes add to under a lock."""
import multiprocessing

import pytest

from clients.stats import MAX_ROWS, SharedCounters, SharedRows

ADDS = 100_000


def _add(counters: SharedCounters, row: int, start) -> None:
    start.wait(60)
    for _ in range(ADDS):
        counters.add(row, hits=1, store_bytes=3)


@pytest.mark.parametrize("rows", [
    (1, MAX_ROWS + 1),            # worker 0 and worker 129: the same row, once (row % 129)
    (MAX_ROWS, MAX_ROWS + 1),     # two workers past the table: both in the overflow row
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


def test_rows_are_summed_and_the_overflow_row_is_no_ones_own():
    c = SharedRows(2)
    c.add(0, {0: 1})
    c.add(MAX_ROWS - 1, {1: 2})
    c.add(MAX_ROWS, {0: 10})
    c.add(10 * MAX_ROWS + 1, {0: 100, 1: 5})  # not row 2 (as modulo the table it was)
    c.add(2, {1: 1000})
    assert c.sums() == [111, 1007]
    assert c._arr[2 * 2 + 1] == 1000 and c._arr[2 * 2] == 0
