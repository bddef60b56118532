"""Review of an epoch abandoned while its dispatcher waits on remote work (real Ray head on
loopback, real cacheserver, real loader): the loader's dispatcher thread takes the sampler's
batches through the remote feeder, whose wait for a batch's remote tasks lasts up to
`wait_limit`. An epoch left then (its iterator closed, a `break`) must stop that thread
promptly, so that the next epoch, or close(), is the only user of the remote pool, the local
workers and the sampler: a dispatcher left running in the feeder's wait went on, after the
loader had moved on, settling tasks close() had dropped, pulling the abandoned epoch's
batches from the sampler and reading the next epoch's workers' messages."""
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from rayhead import started  # noqa: E402
from remote_steps import Gate, Jitter, decode  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)
N, B, SEED = 96, 4, 5
HELD = 7          # sampler batches before the held ones: the epoch yields some before its dispatcher waits
WAIT_LIMIT = 90.0  # the feeder's: far longer than any bound below
HOLD_S = 120.0    # a held item's longest hold (the flag file removed ends it sooner)


@pytest.fixture
def head(shared_head):
    """The shared Ray head (conftest), this process joined as the user (the pool uses that connection)."""
    if not ray.is_initialized():
        shared_head.connect()
    return shared_head


def held_loader(tmp_path, server, head, job):
    """A loader whose remote worker holds the items of the sampler's batches from HELD on
    while tmp_path/hold exists; (loader, flag). The flag is made after the loader's
    profiling (which runs the steps here on sample items)."""
    sampler = SubstitutableBatchSampler(N, B, None, seed=SEED)
    sampler.set_epoch(0)
    held = [i for b in list(sampler)[HELD:] for i in b]
    flag = tmp_path / "hold"
    pipe = Pipeline([decode, Gate({2 * i for i in held}, str(flag), HOLD_S), Jitter()])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=server.address, job=job, transform=pipe)
    opts = dict(autoscale=AutoscaleConfig(min_workers=1, max_workers=1), wait_limit=WAIT_LIMIT, task_items=4,
                window=4)
    loader = ds.loader(B, num_workers=1, seed=SEED, substitute=False, cost_dir=False, remote=head.address,
                       remote_options=opts)
    assert loader.remote is not None and loader.remote.pool.broken is None
    flag.touch()
    return ds, loader, flag


def waiting_on_remote(loader, it):
    """Start the epoch; once a batch came out, wait until its dispatcher is held in the
    feeder's wait (it has taken the batches before the held ones and takes no more)."""
    next(it)
    run = loader.preprocess.last_run
    deadline = time.monotonic() + 60
    while run.pulled < HELD * B and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert run.pulled == HELD * B and run._thread.is_alive(), (run.pulled, run.error)
    return run


def bounded_epoch(loader, limit):
    """One epoch in a thread of its own, given `limit` seconds: (batches, error); None
    where it had not ended by then."""
    out = {}

    def go():
        try:
            out["batches"] = [b for b in loader]
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        return None
    return out.get("batches"), out.get("error")


def accounted(pool):
    """Every item sent to a remote worker is counted once: made, present, failed or lost."""
    c = pool.counts
    return c.items == c.made + c.present + c.failed + c.lost + sum(len(t.indices) for t in pool.tasks.values())


def test_an_epoch_left_while_the_feeder_waits_stops_before_the_next_one(head, module_server, tmp_path):
    """Before: leaving the epoch took the dispatcher's whole 10 s join, and the dispatcher ran
    on beside the next epoch once its wait ended, taking the left epoch's batches."""
    ds, loader, flag = held_loader(tmp_path, module_server, head, "ab-next")
    try:
        it = iter(loader)
        run = waiting_on_remote(loader, it)
        t0 = time.monotonic()
        it.close()                                   # the training loop left the epoch
        left_in = time.monotonic() - t0
        still, pulled = run._thread.is_alive(), run.pulled
        flag.unlink()                                # the held remote task ends now
        got = bounded_epoch(loader, 120)
        assert got is not None, "the next epoch did not end within 120 s"
        batches, error = got
        assert error is None, repr(error)
        assert sum(len(b) for b in batches) == N and loader.preprocess.yielded() == set(range(N))
        st, sst = loader.epoch_stats[-1], loader.batch_sampler.stats
        assert st.complete and st.batches == N // B and (sst.batches, sst.items) == (N // B, N), (st, sst)
        run._thread.join(30)
        assert left_in < 5.0 and not still, (left_in, still)  # told to stop: not its 10 s join, not left running
        assert run.pulled == pulled and run.error is None, (pulled, run.pulled, repr(run.error))
        assert accounted(loader.remote.pool), loader.remote.pool.counts
    finally:
        if flag.exists():
            flag.unlink()
        loader.close()
        ds.close()


def test_an_epoch_left_while_the_feeder_waits_then_close(head, module_server, tmp_path):
    """Before: the two calls took over 10 s, and the dispatcher left waiting settled, after
    close(), tasks close() had dropped (a KeyError in its thread)."""
    ds, loader, flag = held_loader(tmp_path, module_server, head, "ab-close")
    try:
        it = iter(loader)
        run = waiting_on_remote(loader, it)
        pool = loader.remote.pool
        t0 = time.monotonic()
        it.close()
        loader.close()
        took = time.monotonic() - t0
        flag.unlink()
        run._thread.join(30)
        assert not run._thread.is_alive() and run.error is None, repr(run.error)
        assert took < 8.0, took
        assert pool.closed and pool.tasks == {} and pool.workers == {} and accounted(pool), pool.counts
    finally:
        if flag.exists():
            flag.unlink()
        loader.close()
        ds.close()


def test_close_ends_a_wait_of_another_thread_on_the_pool(head, module_server, tmp_path):
    """The dispatcher's thread waits on a remote task (no stop asked) while the trainer's
    closes the pool. Before: that wait ran on until Ray reported the killed worker's task,
    then settled a task close() had dropped: KeyError in the waiting thread."""
    flag = tmp_path / "hold"
    pipe = Pipeline([decode, Gate({2 * i for i in range(1, 8)}, str(flag), HOLD_S), Jitter()])
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=module_server.address, job="ab-pool", transform=pipe)
    rw = started(ds, pipe, head.address, autoscale=AutoscaleConfig(min_workers=1, max_workers=1))
    waiter = None
    try:
        pool = rw.pool
        first = pool.submit(0, [0])                       # item 0 is not held: the worker starts
        assert first is not None and pool.wait([first], 90.0) == []
        flag.touch()
        ref = pool.submit(0, [1, 2, 3])
        assert ref is not None
        out = {}

        def wait():
            try:
                out["rest"] = pool.wait([ref], 60.0)
            except BaseException as e:
                out["error"] = e

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive()                          # held in Ray's wait
        t0 = time.monotonic()
        rw.close()
        closed_in = time.monotonic() - t0
        waiter.join(30)
        assert not waiter.is_alive() and "error" not in out, repr(out.get("error"))
        assert out["rest"] == [] and closed_in < 8.0, (out, closed_in)
        assert pool.tasks == {} and pool.workers == {} and accounted(pool) and pool.counts.lost == 3, pool.counts
    finally:
        if flag.exists():
            flag.unlink()
        if waiter is not None:
            waiter.join(30)
        rw.close()
        ds.close()


class _StallingStarts:
    """A Ray Client whose actor starts stall after the first `free` (a cluster lost unnoticed,
    within Ray's reconnect grace): each blocks until `release` is set (10 s at most). Kills are
    recorded. A stall on demand is what a real head does not give."""

    def __init__(self, free: int) -> None:
        self.free, self.started, self.killed = free, [], []
        self.release, self.stalled = threading.Event(), threading.Event()

    def remote(self, **kw):  # ray.remote(...)(PrefixRunner): the actor class
        return lambda cls: _ActorClass(self)

    def start(self):
        if len(self.started) >= self.free:
            self.stalled.set()
            self.release.wait(10)
        handle = SimpleNamespace(configure=SimpleNamespace(remote=lambda spec: None))
        self.started.append(handle)
        return handle

    def is_initialized(self):
        return True

    def nodes(self):  # one live node that takes the workers (pool.check_placeable)
        return [{"Alive": True, "Resources": {"CPU": 4.0}}]

    def kill(self, handle):
        self.killed.append(handle)


class _ActorClass:
    def __init__(self, fake):
        self.fake = fake

    def options(self, **kw):
        return self

    def remote(self):
        return self.fake.start()


def test_close_is_bounded_while_another_thread_starts_workers_and_none_outlives_it(monkeypatch):
    """The controller (on the dispatcher's thread) starts workers while the trainer's thread
    closes the pool, and a start stalls. close() waits for it a bounded time; a worker whose
    start ends after close() is stopped, and no other starts. Before: the resize went on after
    close(), and the workers it started ran on, never stopped."""
    from preprocess.remote import pool as poolmod

    monkeypatch.setattr(poolmod, "CLOSE_LOCK_S", 0.5, raising=False)
    fake = _StallingStarts(free=1)
    pool = poolmod.RemotePool(fake, SimpleNamespace(version=1))
    grow = threading.Thread(target=pool.resize, args=(3,), daemon=True)
    try:
        grow.start()
        assert fake.stalled.wait(10)                      # the second start stalls, the lock held
        t0 = time.monotonic()
        pool.close()
        closed_in = time.monotonic() - t0
        fake.release.set()
        grow.join(10)
        assert not grow.is_alive() and closed_in < 3.0, closed_in
        assert len(fake.started) == 2 and all(any(k is h for k in fake.killed) for h in fake.started), \
            (len(fake.started), len(fake.killed))
        assert pool.workers == {}
    finally:
        fake.release.set()
