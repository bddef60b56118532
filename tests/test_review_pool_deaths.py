"""Review of the remote pool's dead, unavailable and orphaned workers on a real Ray head
(loopback) and a real cacheserver: a draining worker that dies is not replaced (the pool
stays at its target); a worker Ray reports unavailable (it may come back) is killed as it
is replaced; a pool broken by a passing error on a connection another pool still holds
kills its own workers instead of leaving them running, holding CPUs, until the connection
closes. Where Ray's own error cannot be provoked on demand (ActorUnavailableError: a
network partition between the client server and a live worker; a passing failure of a
client call), the real `ray` module is wrapped to raise it once: every other call, and
the workers, are real."""
import os
import signal
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.remote import pool as poolmod  # noqa: E402
from rayhead import disconnect, started  # noqa: E402
from remote_steps import Jitter, Slow, decode  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)
ONE = dict(autoscale=AutoscaleConfig(min_workers=1, max_workers=1))
TWO = dict(autoscale=AutoscaleConfig(min_workers=2, max_workers=2))


@pytest.fixture
def head(shared_head):
    """The pytest process's shared Ray head (conftest), idle as this module began."""
    return shared_head


class Flaky:
    """The real ray module, but for one injected error: `get` of the refs in `unavailable`
    raises ActorUnavailableError (as Ray does for a worker it cannot reach, which may come
    back); the next `wait` raises `wait_error` once."""

    def __init__(self, real, unavailable=(), wait_error=None):
        self._real, self.unavailable, self.wait_error = real, set(unavailable), wait_error

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get(self, ref, **kw):
        if ref in self.unavailable:
            self.unavailable.discard(ref)
            raise self._real.exceptions.ActorUnavailableError("injected: its node is unreachable", None)
        return self._real.get(ref, **kw)

    def wait(self, refs, **kw):
        if self.wait_error is not None:
            e, self.wait_error = self.wait_error, None
            raise e
        return self._real.wait(refs, **kw)


def warm(pool):
    """One task on each worker until it answers (a starting worker takes no other); their pids."""
    refs = [pool.submit(0, [i]) for i in range(len(pool.workers))]
    assert None not in refs and pool.wait(refs, 90.0) == []
    return {w.wid: ray.get(w.handle.pid.remote(), timeout=60) for w in pool.workers.values()}


def is_dead(handle) -> bool:
    try:
        ray.get(handle.pid.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


def dies(handle, within: float = 30.0) -> bool:
    """Does this actor die within `within` seconds? Ray's kill is asynchronous (the GCS
    kills the actor after `ray.kill` returns), and a pool bounds its wait for the kill call
    itself (KILL_WAIT_S): a call sent just after can still be answered."""
    deadline = time.monotonic() + within
    while not is_dead(handle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def dataset(tmp_path, job, pipe, server, n=16):
    return CachedDataset(indexed_items(tmp_path / "ds", n), cache=server.address, job=job, transform=pipe)


def test_a_draining_worker_that_dies_is_not_replaced(head, module_server, tmp_path):
    """Scaled from 2 to 1, the drained worker (tasks still queued) is killed: its tasks are
    lost, and the pool stays at one worker, not two."""
    pipe = Pipeline([decode, Slow(0.3), Jitter()])
    ds = dataset(tmp_path, "pd-drain-dies", pipe, module_server)
    rw = started(ds, pipe, head.address, **TWO)
    try:
        pool = rw.pool
        pids = warm(pool)
        refs = [pool.submit(0, list(range(k, k + 3))) for k in range(2, 14, 3)]
        assert None not in refs and len({t.wid for t in pool.tasks.values()}) == 2
        pool.resize(1)
        drained = [w for w in pool.workers.values() if w.draining]
        assert len(drained) == 1 and drained[0].queued > 0 and pool.size == 1
        os.kill(pids[drained[0].wid], signal.SIGKILL)
        assert pool.wait(refs, 90.0) == []
        c = pool.counts
        assert c.deaths == 1 and c.lost > 0 and pool.broken is None
        assert pool.size == 1 and len(pool.workers) == 1 and pool.replaced == 0
    finally:
        rw.close()
        ds.close()


def test_an_unavailable_worker_is_killed_as_it_is_replaced(head, module_server, tmp_path):
    """Ray says a worker is unavailable (it may come back): the pool replaces it, and kills
    it, or it would run on, unaccounted, holding a CPU."""
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = dataset(tmp_path, "pd-unavailable", pipe, module_server)
    rw = started(ds, pipe, head.address, **ONE)
    try:
        pool = rw.pool
        warm(pool)
        (old,) = pool.workers.values()
        ref = pool.submit(0, [3, 4])
        pool.ray = Flaky(ray, unavailable=[ref])
        assert pool.wait([ref], 90.0) == []
        assert pool.counts.deaths == 1 and pool.counts.lost == 2 and pool.broken is None
        assert pool.size == 1 and old.wid not in pool.workers   # replaced
        assert dies(old.handle)                                 # and the old one stopped
        (new,) = pool.workers.values()
        assert not is_dead(new.handle)
    finally:
        rw.close()
        ds.close()


def test_a_broken_pool_kills_its_workers_on_a_connection_another_pool_holds(head, module_server, tmp_path):
    """Two loaders' pools on one connection; one breaks on a passing error of a Ray call:
    it kills its own workers (else they hold their CPUs until the other pool closes the
    connection), and the other pool works on."""
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = dataset(tmp_path, "pd-break-shared", pipe, module_server)
    a = b = None
    try:
        a = started(ds, pipe, head.address, **ONE)
        b = started(ds, pipe, head.address, **ONE)
        warm(a.pool)
        (wa,) = a.pool.workers.values()
        ref = a.pool.submit(0, [5, 6])
        a.pool.ray = Flaky(ray, wait_error=ConnectionError("a passing hiccup"))
        with pytest.warns(RuntimeWarning, match="remote preprocessing workers lost.*passing hiccup"):
            assert a.pool.wait([ref], 60.0) == []
        assert a.pool.broken and a.pool.workers == {} and ray.is_initialized()
        assert dies(wa.handle)                                  # killed, not left running
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref = b.pool.submit(0, [7, 8])
            assert ref is not None and b.pool.wait([ref], 90.0) == []
        assert b.pool.broken is None and b.pool.counts.made + b.pool.counts.present == 2
    finally:
        for rw in (a, b):
            if rw is not None:
                rw.close()
        disconnect(ray)
        ds.close()


class _Method:
    def remote(self, *args):
        return object()


class _Handle:
    configure = run = _Method()


class _ActorClass:
    def options(self, **kw):
        return self

    def remote(self):
        return _Handle()


class StalledRay:
    """A Ray Client whose connection stalls (a lost cluster, within Ray's reconnect grace):
    each kill blocks for 10 s; wait() fails."""

    def __init__(self):
        self.release = threading.Event()
        self.kills = 0

    def remote(self, **kw):
        return lambda cls: _ActorClass()

    def is_initialized(self):
        return True

    def nodes(self):  # one live node that takes the workers (pool.check_placeable)
        return [{"Alive": True, "Resources": {"CPU": 4.0}}]

    def kill(self, handle):
        self.kills += 1
        self.release.wait(10)

    def wait(self, refs, **kw):
        raise ConnectionError("the connection stalled, then failed")


def test_killing_the_workers_on_a_stalled_connection_is_bounded(monkeypatch):
    """close(), and a break on the user's connection (it stays open), kill the workers
    waiting a bounded time: a cluster lost unnoticed stalls each Ray call for the reconnect
    grace period, three workers three times over. A fake `ray`: a stalled connection on
    demand is what a real head does not give (killing it ends the connection for good)."""
    monkeypatch.setattr(poolmod, "KILL_WAIT_S", 0.5, raising=False)  # none before the fix
    spec = SimpleNamespace(version=1)
    stalled = StalledRay()
    try:
        closing = poolmod.RemotePool(stalled, spec)
        closing.resize(3)
        t0 = time.monotonic()
        closing.close()
        assert time.monotonic() - t0 < 3.0 and stalled.kills == 1   # not waited out
        breaking = poolmod.RemotePool(stalled, spec)                 # share None: the user's connection
        breaking.resize(3)
        ref = breaking.submit(0, [0, 1])
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="workers lost.*stalled"):
            assert breaking.wait([ref], 1.0) == []
        assert time.monotonic() - t0 < 3.0 and stalled.kills == 2   # it tried, bounded
    finally:
        stalled.release.set()
