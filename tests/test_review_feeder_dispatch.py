"""The remote feeder's wait must not stall the loader's local pipeline (real loader, real
spawned local workers, real files; the remote pool is an in-process one whose tasks finish
when the test says, as in test_remote_units). The loader's dispatcher thread takes the
sampler's batches through the feeder, which hands a batch on once its remote work is done or
`wait_limit` has passed. Before: the feeder's wait ran in the dispatcher thread, which then
read no local worker's result nor sent any task: a batch the local workers could make at once
waited for a later batch's slow remote work (up to wait_limit, 10 s by default), so one slow
remote batch stalled the trainer."""
import os
import sys
import threading
import time
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.remote.feeder import Feeder  # noqa: E402
from preprocess_steps import first, index_of, pad  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_remote_units import RecordingPool, batches  # noqa: E402

pytestmark = pytest.mark.timeout(180)
N, B = 32, 4
WAIT_LIMIT = 60.0   # the feeder's: far longer than any bound below
FIRST_S = 20.0      # a batch the local workers make comes well within this (spawned workers, a busy host)


class GatedPool(RecordingPool):
    """Tasks from the `free`-th on are unfinished until `gate` is set (a slow remote batch);
    its waits end at their timeout or a stop, as RemotePool's do (in short slices)."""

    def __init__(self, free: int = 1) -> None:
        super().__init__()
        self.free, self.gate = free, threading.Event()
        self.waiting = threading.Event()  # a wait on a held task is under way
        self.closed = False

    def wait(self, refs, timeout, stop=None):
        self.waits.append(list(refs))
        deadline = time.monotonic() + timeout
        held = [r for r in refs if r > self.free]
        while held and not self.gate.is_set() and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                break
            self.waiting.set()
            self.gate.wait(0.05)
        self.waiting.clear()
        rest = held if not self.gate.is_set() else []
        for r in refs:
            if r not in rest:
                self.tasks.pop(r, None)
        return rest

    def close(self):
        self.closed = True
        self.gate.set()


class Remote:
    """What the loader uses of preprocess.remote.RemoteWorkers (batches, close)."""

    def __init__(self, feeder: Feeder) -> None:
        self.feeder = feeder

    def batches(self, source, epoch):
        return self.feeder.batches(source, epoch)

    def close(self):
        self.feeder.pool.close()


def feeder_threads():
    return [t for t in threading.enumerate() if t.name == "remote-feeder" and t.is_alive()]


def gated_loader(tmp_path, pool, **feeder):
    pipe = Pipeline([index_of, pad, first])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    loader = ds.loader(B, num_workers=1, seed=3, cost_dir=False)
    loader.remote = Remote(Feeder(pool, window=1, task_items=B, wait_limit=WAIT_LIMIT, **feeder))
    return ds, loader


def consume(loader, out):
    """One epoch in a thread of its own: each batch (and when it came) into `out`."""
    def go():
        try:
            for b in loader:
                out.setdefault("batches", []).append((time.monotonic(), [int(i) for i in b]))
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_a_batch_the_local_workers_made_comes_while_the_feeder_waits_on_a_later_one(tmp_path):
    """The sampler's second batch's remote task is slow; the first's is done. Before: the
    dispatcher waited in the feeder for the second batch (wait_limit, 60 s) before it sent the
    first batch's items to the local workers: no batch came until then."""
    pool = GatedPool(free=1)
    ds, loader = gated_loader(tmp_path, pool)
    out, t = {}, None
    try:
        t0 = time.monotonic()
        t = consume(loader, out)
        deadline = t0 + FIRST_S
        while not out.get("batches") and "error" not in out and time.monotonic() < deadline:
            time.sleep(0.05)
        came = out.get("batches", [])[:1]
        still_waiting = pool.waiting.is_set() and not pool.gate.is_set()
        pool.gate.set()                                   # the slow remote task ends now
        t.join(60)
        assert "error" not in out, repr(out.get("error"))
        assert came, f"no batch within {FIRST_S} s while the feeder waited on a later batch's remote work"
        assert still_waiting                              # it came during that wait, not after it
        assert not t.is_alive()
        got = [i for _, b in out["batches"] for i in b]
        assert Counter(got) == Counter(range(N))          # every item once, the epoch complete
        assert loader.epoch_stats[-1].complete
        assert loader.remote.feeder.stats.timed_out == 0 and loader.remote.feeder.stats.batches == N // B
        assert not feeder_threads()
    finally:
        pool.gate.set()
        if t is not None:
            t.join(60)
        loader.close()
        ds.close()


def test_an_epoch_left_while_the_feeder_waits_ends_its_thread(tmp_path):
    """Left (iterator closed) while the feeder waits on remote work: the wait ends, the
    feeder's thread ends, no batch after; the next epoch runs whole."""
    pool = GatedPool(free=1)
    ds, loader = gated_loader(tmp_path, pool)
    try:
        it = iter(loader)
        next(it)
        assert pool.waiting.wait(FIRST_S)
        t0 = time.monotonic()
        it.close()
        left_in = time.monotonic() - t0
        assert left_in < 3.0 and not feeder_threads(), (left_in, feeder_threads())
        assert not pool.gate.is_set() and not pool.waiting.is_set()
        pool.gate.set()
        got = [int(i) for b in loader for i in b]
        assert Counter(got) == Counter(range(N)) and not feeder_threads()
    finally:
        pool.gate.set()
        loader.close()
        ds.close()


def test_on_batch_runs_in_the_consumer_thread_before_the_next_batch_is_sent():
    """The controller (on_batch) may resize the local workers the dispatcher uses and sets
    the local share: it runs in the thread that takes the batches, once per batch, and its
    share applies to every batch the feeder sends after it."""
    pool = RecordingPool()
    seen = []

    def on_batch(f):
        seen.append((threading.current_thread().name, len(pool.sent)))
        f.local_share = 1.0                               # the rest stays local

    f = Feeder(pool, window=1, task_items=8, on_batch=on_batch)
    run = f.batches(iter(batches(32, 8)), 0)
    assert list(run) == batches(32, 8)
    me = threading.current_thread().name
    assert seen == [(me, 1)] * 4                          # sent after the first batch: none
    assert f.stats.remote_items == 8 and f.stats.local_items == 24 and f.stats.batches == 4
    assert not feeder_threads()


def test_a_feed_run_dropped_or_its_pool_closed_leaves_no_thread():
    """A run dropped unfinished (no stop()) ends its thread; one whose pool is closed
    meanwhile ends it too, and its consumer gets an error, not a silently short epoch."""
    pool = GatedPool(free=0)
    run = Feeder(pool, window=1, task_items=8, wait_limit=WAIT_LIMIT).batches(iter(batches(32, 8)), 0)
    assert run.next_ready(0.0) is None and pool.waiting.wait(10)   # asked: its wait is under way
    del run
    deadline = time.monotonic() + 10
    while feeder_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not feeder_threads()
    pool = RecordingPool()
    pool.closed = False
    run = Feeder(pool, window=1, task_items=8).batches(iter(batches(32, 8)), 0)
    assert next(run) == batches(32, 8)[0]
    pool.closed = True
    with pytest.raises(RuntimeError, match="closed"):
        next(run)
    assert not feeder_threads()
