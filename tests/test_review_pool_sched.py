"""Review of the remote pool's workers Ray cannot place, and of whom a scale-down stops, on a
real Ray head (loopback, 2 CPUs) and a real cacheserver: workers that ask for more than any
node has are not started one by one to pend for ever (Ray gives no error for them), the pool
breaks at once naming the resource and every item is made locally without a wait; workers
Ray reports it cannot schedule are not replaced one by one, each waiting to fail alike; a
scale-down stops a still-starting worker (no work done yet) rather than a busy one. Where
Ray's own error cannot be provoked on demand (ActorUnschedulableError, for a node-affinity or
placement-group actor the pool does not make), the real `ray` module is wrapped to raise it
(test_review_pool_deaths.Flaky): every other call, and the workers, are real."""
import os
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.remote import start  # noqa: E402
from rayhead import started  # noqa: E402
from remote_steps import Jitter, Slow, decode  # noqa: E402
from test_review_pool_deaths import Flaky, dataset, warm  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)
TWO = dict(autoscale=AutoscaleConfig(min_workers=2, max_workers=2))


@pytest.fixture
def head(shared_head):
    """The pytest process's shared Ray head (conftest), idle as this module began: its 2 CPUs
    are what these tests fill."""
    return shared_head


class Unplaced(Flaky):
    """The real ray module, but `get` of the refs in `unplaced` raises ActorUnschedulableError
    (as Ray does for an actor whose node or placement group is gone)."""

    def __init__(self, real, unplaced):
        super().__init__(real)
        self.unplaced = set(unplaced)

    def get(self, ref, **kw):
        if ref in self.unplaced:
            self.unplaced.discard(ref)
            raise self._real.exceptions.ActorUnschedulableError("injected: its node is gone")
        return self._real.get(ref, **kw)


def test_workers_no_node_can_take_break_the_pool_at_once_naming_the_resource(head, module_server, tmp_path):
    """cpus=8 on a cluster whose node has 2: Ray would keep each worker pending for ever
    (no error), each holding a task the feeder waits `wait_limit` for. The pool breaks at
    start instead, saying which resource no node has, and the epoch runs locally, unwaited."""
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = dataset(tmp_path, "ps-infeasible", pipe, module_server)
    rw = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rw = start(ds, pipe, 0, head.address, cpus=8, wait_limit=5.0, task_items=2, **TWO)
        said = " | ".join(str(w.message) for w in caught)
        assert rw is not None, said
        assert rw.pool.broken and "CPU: 8" in rw.pool.broken and "CPU: 2" in rw.pool.broken, said
        assert "CPU: 8" in said and rw.pool.workers == {}
        t0 = time.monotonic()
        seen = [i for b in rw.batches([list(range(k, k + 4)) for k in range(0, 16, 4)], 0) for i in b]
        assert seen == list(range(16)) and time.monotonic() - t0 < 5.0   # not one wait_limit waited
        st = rw.feeder.stats
        assert st.timed_out == 0 and st.local_items == 16 and st.remote_items == 0
        assert rw.controller.fell_back
    finally:
        if rw is not None:
            rw.close()
        ds.close()


def test_workers_ray_cannot_schedule_are_not_replaced_one_by_one(head, module_server, tmp_path):
    """Both workers' tasks fail as unschedulable: each asks for what the other does, so a
    replacement would only wait to fail alike. Neither is replaced: the first is killed, the
    second, the last taking tasks, breaks the pool, in one wait."""
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = dataset(tmp_path, "ps-unschedulable", pipe, module_server)
    rw = started(ds, pipe, head.address, **TWO)
    try:
        pool = rw.pool
        warm(pool)
        refs = [pool.submit(0, [2, 3]), pool.submit(0, [4, 5])]
        assert None not in refs and len({t.wid for t in pool.tasks.values()}) == 2
        pool.ray = Unplaced(ray, refs)
        with pytest.warns(RuntimeWarning, match="workers lost.*ActorUnschedulableError"):
            assert pool.wait(refs, 90.0) == []
        assert pool.broken and pool.replaced == 0 and pool.counts.deaths == 1
        assert pool.counts.lost == 4 and pool.workers == {}
    finally:
        rw.close()
        ds.close()


def test_one_worker_ray_cannot_schedule_leaves_the_others_and_starts_none(head, module_server, tmp_path):
    """One worker unschedulable, the other runs: the pool shrinks to the one that runs (not
    broken), and a scale-up starts none (one warning naming Ray's error)."""
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = dataset(tmp_path, "ps-unschedulable-one", pipe, module_server)
    rw = started(ds, pipe, head.address, **TWO)
    try:
        pool = rw.pool
        warm(pool)
        refs = [pool.submit(0, [2, 3]), pool.submit(0, [4, 5])]
        pool.ray = Unplaced(ray, refs[:1])
        assert pool.wait(refs, 90.0) == []
        assert pool.broken is None and pool.replaced == 0 and pool.size == 1
        with pytest.warns(RuntimeWarning, match="could not be scheduled.*ActorUnschedulableError"):
            pool.resize(2)
        assert pool.size == 1 and pool.exhausted
        ref = pool.submit(0, [6, 7])
        assert ref is not None and pool.wait([ref], 90.0) == [] and pool.broken is None
    finally:
        rw.close()
        ds.close()


def test_scale_down_stops_a_starting_worker_before_a_busy_one(head, module_server, tmp_path):
    """Two running workers with tasks queued, a third still starting (no CPU left for it)
    with a larger task: scaled back to two, the starting one is stopped at once (its task's
    items go to the trainer), not a running one made to drain its queue."""
    pipe = Pipeline([decode, Slow(0.3), Jitter()])
    ds = dataset(tmp_path, "ps-drain-starting", pipe, module_server)
    rw = started(ds, pipe, head.address, **TWO)
    try:
        pool = rw.pool
        warm(pool)
        running = set(pool.workers)
        busy = [pool.submit(0, [2, 3]), pool.submit(0, [4, 5])]
        assert None not in busy and {t.wid for t in pool.tasks.values()} == running
        pool.resize(3)
        (new,) = set(pool.workers) - running
        big = pool.submit(0, list(range(6, 14)))
        assert big is not None and pool.tasks[big].wid == new and pool.workers[new].finished == 0
        pool.resize(2)
        assert set(pool.workers) == running and pool.size == 2
        assert not any(w.draining for w in pool.workers.values())
        assert pool.wait(busy + [big], 90.0) == []
        c = pool.counts
        assert c.lost == 8 and c.made + c.present + c.lost == c.items and c.deaths == 0 and pool.broken is None
    finally:
        rw.close()
        ds.close()
