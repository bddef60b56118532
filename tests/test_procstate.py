"""A process's state of a CachedDataset (clients/procstate.py) is made once, however many
threads ask for it at once (the training loop and the manager's prefetch thread), and
a forked child can make its own even if a thread held the lock at the fork."""
import os
import sys
import threading

import pytest

pytest.importorskip("torch")

from test_dataset import make_dataset  # noqa: E402

from clients import procstate  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402


@pytest.fixture
def digest(tmp_path):
    return make_dataset(tmp_path / "ds", n=8)


def _together(n: int, fn) -> list:
    """fn() from n threads released at once."""
    out, barrier = [None] * n, threading.Barrier(n)

    def run(k):
        barrier.wait()
        out[k] = fn()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def test_threads_asking_at_once_get_one_state(digest):
    path, items = digest
    for _ in range(10):  # each a fresh dataset: a race lost once would show
        ds = CachedDataset(path, cache=False)
        try:
            states = _together(4, ds._proc)
            assert all(st is states[0] for st in states)
            assert ds._state is states[0]
        finally:
            ds.close()


def test_prefetch_and_reads_at_once_share_one_state(digest):
    """As the manager's prefetch thread and the training loop start together."""
    path, items = digest
    for _ in range(5):
        ds = CachedDataset(path, cache=False)
        try:
            seen = _together(2, lambda: (ds.prefetch([0, 1]), ds.read([2]), ds._state)[2])
            assert seen[0] is seen[1] is ds._state
        finally:
            ds.close()


def test_an_autocache_feeds_threads_asking_at_once_get_one_state(digest):
    """The feed's per-process side (clients/autofeed.py): a worker's foreground and
    background threads both ask for it."""
    from clients.autofeed import CacheFeed

    path, items = digest
    ds = CachedDataset(path, cache=False)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the state is quick to make: threads switch often enough to race
    try:
        for _ in range(20):
            feed = CacheFeed(ds, None, None)
            states = _together(4, feed.proc)
            assert all(st is states[0] for st in states)
            feed.close()
    finally:
        sys.setswitchinterval(interval)
        ds.close()


def test_a_forked_child_makes_its_state_though_a_thread_held_the_lock(digest):
    path, items = digest
    ds = CachedDataset(path, cache=False)
    holding, done = threading.Event(), threading.Event()

    def hold():  # a thread of the parent making some state as the fork happens
        with procstate._making:
            holding.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    holding.wait(60)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            ok = ds.read([0]) == [items[0]]  # would wait forever on the inherited, held lock
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    ready: list = []
    try:
        import select
        ready, _, _ = select.select([r], [], [], 30)
        assert ready and os.read(r, 1) == b"1"
    finally:
        done.set()
        t.join()
        os.close(r)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        ds.close()
