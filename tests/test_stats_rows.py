"""The loader statistics' rows in shared memory (clients/stats.py): each process claims a row
of its own, so no two processes ever add to one row and nothing is lost; a row whose process
ended is claimed again; a process past the rows is refused."""
import multiprocessing
import os

import pytest

from clients.stats import MAX_ROWS, SharedCounters, SharedRows

ADDS = 100_000


def _add(counters: SharedCounters, start) -> None:
    start.wait(60)
    for _ in range(ADDS):
        counters.add(hits=1, store_bytes=3)


@pytest.mark.parametrize("method", ["spawn", "fork"])  # a forked child does not keep its parent's row
def test_processes_adding_at_once_lose_nothing(method):
    ctx = multiprocessing.get_context(method)
    counters, start = SharedCounters(), ctx.Event()
    counters.add(hits=0)  # this process's row claimed before a fork copies it
    procs = [ctx.Process(target=_add, args=(counters, start)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()  # together, with this process too: their adds interleave
    for _ in range(ADDS):
        counters.add(hits=1, store_bytes=3)
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    totals = counters.totals()
    assert (totals["hits"], totals["store_bytes"]) == (3 * ADDS, 9 * ADDS)


def _ended_pid() -> int:
    p = multiprocessing.get_context("spawn").Process(target=os.getpid)
    p.start()
    p.join(60)
    assert p.exitcode == 0
    return p.pid


def test_rows_are_summed_reclaimed_once_their_process_ended_and_a_process_past_them_is_refused():
    c = SharedRows(2)
    alive = os.getppid()  # a process that outlives the test: its rows are never taken
    c._owners[:] = [alive] * MAX_ROWS
    c._arr[0], c._arr[7] = 10, 1000  # counts of processes before this one (rows 0 and 3)
    with pytest.raises(ValueError, match=f"rows for {MAX_ROWS} processes at once .* live processes "
                                         f"hold them all: use fewer workers"):
        c.add({0: 1})
    assert c.sums() == [10, 1000]
    c._owners[3] = _ended_pid()
    c.add({0: 1})
    c.add({1: 2})  # the row this process claimed
    assert c._owners[3] == os.getpid() and list(c._arr[6:8]) == [1, 1002]
    assert c.sums() == [11, 1002]  # the ended process's counts stay in the sums
