"""clients/daemonpool.py: store reads' thread pool. Its threads are daemons (an exit never waits
for a read that never returns: tests/test_review_clients_exit_s32.py) and, as concurrent.futures'
pool, end once the pool is shut down or dropped (a dataset dropped without close)."""
import gc
import threading
import time

import pytest

from clients.daemonpool import DaemonPool


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix + "_")]


def _gone(prefix: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _threads(prefix) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _threads(prefix)


def test_a_dropped_pool_lets_its_threads_end():
    pool = DaemonPool(3, "dp-dropped")
    assert [f.result(10) for f in [pool.submit(time.sleep, 0.05) for _ in range(6)]] == [None] * 6
    assert 1 <= len(_threads("dp-dropped")) <= 3 and all(t.daemon for t in _threads("dp-dropped"))
    del pool
    gc.collect()
    assert _gone("dp-dropped"), "threads of a pool nobody holds run on (leaked)"


def test_shutdown_ends_the_threads_and_refuses_new_tasks_and_cancels_queued_ones():
    pool = DaemonPool(1, "dp-shut")
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    queued = pool.submit(int, "7")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)
    gate.set()
    assert running.result(10) is True and _gone("dp-shut")
    pool.shutdown()  # again: nothing


def test_max_workers_is_checked():
    with pytest.raises(ValueError, match="max_workers >= 1"):
        DaemonPool(0)
