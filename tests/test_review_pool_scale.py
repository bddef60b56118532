"""Review of RemotePool's bookkeeping when workers cannot be scheduled, keep dying, or are
drained and wanted back. A small in-process stand-in for the `ray` module (actors are
handles that record their calls; a task's outcome is set by the test) with Ray's own
exception classes: what is checked is which workers the pool starts, kills and keeps."""
import os
import sys
import warnings
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from preprocess.remote.pool import RemotePool, Unplaceable, check_placeable  # noqa: E402

PENDING = object()


class Ref:
    def __init__(self, handle, indices):
        self.handle, self.indices, self.outcome = handle, indices, PENDING


class Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def remote(self, *args):
        if self.name == "configure":
            self.handle.specs.append(args[0])
            return None
        ref = Ref(self.handle, list(args[-1]))
        self.handle.refs.append(ref)
        return ref


class Handle:
    def __init__(self, n):
        self.n, self.refs, self.specs, self.killed = n, [], [], False
        self.configure, self.run = Method(self, "configure"), Method(self, "run")

    def answer(self):
        """Its pending tasks finish: every item made."""
        for r in self.refs:
            if r.outcome is PENDING:
                r.outcome = [(i, 0.01, "made") for i in r.indices]

    def fail(self, error):
        """Its pending tasks fail with `error` (as Ray raises it from get)."""
        for r in self.refs:
            if r.outcome is PENDING:
                r.outcome = error


class FakeRay:
    """The calls RemotePool makes, with Ray's exception classes."""
    exceptions = ray.exceptions

    def __init__(self):
        self.handles = []

    def remote(self, **opts):
        fake = self

        class ActorClass:
            @staticmethod
            def options(**kw):
                return ActorClass

            @staticmethod
            def remote():
                h = Handle(len(fake.handles))
                fake.handles.append(h)
                return h

        return lambda cls: ActorClass

    def is_initialized(self):
        return True

    def nodes(self):  # one live node that takes the workers (pool.check_placeable)
        return [{"Alive": True, "Resources": {"CPU": 4.0}}]

    def kill(self, h):
        h.killed = True

    def wait(self, refs, num_returns, timeout):
        done = [r for r in refs if r.outcome is not PENDING]
        return done, [r for r in refs if r.outcome is PENDING]

    def get(self, ref, timeout=None):
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome


def make_pool(n, max_replace=8):
    fake = FakeRay()
    pool = RemotePool(fake, SimpleNamespace(version=1), max_replace=max_replace)
    pool.resize(n)
    return fake, pool


def run_one_each(pool, outcome=None):
    """One task on every worker taking tasks; `outcome(handle)` settles them (default: all
    answer); then the pool settles what finished."""
    refs = [pool.submit(0, [10 + w.wid]) for w in list(pool.workers.values()) if not w.draining]
    assert None not in refs
    for r in refs:
        (outcome or Handle.answer)(r.handle)
    pool.wait(refs, 0.0)
    return refs


def alive(fake):
    return [h for h in fake.handles if not h.killed]


@pytest.mark.parametrize("error", [ray.exceptions.ActorUnschedulableError("its node is gone"),
                                   ray.exceptions.ActorPlacementGroupRemoved()],
                         ids=["unschedulable", "placement-group-removed"])
def test_a_worker_ray_cannot_schedule_fails_alone_not_the_pool(error):
    """One worker Ray cannot schedule (its tasks raise ActorUnschedulableError or
    ActorPlacementGroupRemoved, not RayActorErrors): it is killed and not replaced (every
    worker asks for the same: a replacement would only wait to fail alike), and the pool
    goes on with the others; a scale-up starts none (one warning naming the error)."""
    fake, pool = make_pool(2, max_replace=1)
    run_one_each(pool)                                   # both answered: running
    a, b = fake.handles
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # no "workers lost" warning
        run_one_each(pool, lambda h: h.fail(error) if h is a else h.answer())
    assert pool.broken is None
    assert a.killed and not b.killed and pool.counts.deaths == 1 and pool.counts.lost == 1
    assert pool.replaced == 0 and pool.size == 1 and len(fake.handles) == 2
    assert [w.handle for w in pool.workers.values()] == [b]  # the pool goes on with b
    with pytest.warns(RuntimeWarning, match=f"could not be scheduled.*{type(error).__name__}"):
        pool.resize(3)
    assert pool.size == 1 and len(fake.handles) == 2 and pool.exhausted
    assert pool.submit(0, [3]).handle is b


def test_when_no_worker_can_be_scheduled_the_pool_breaks():
    """Every worker taking tasks fails to be scheduled: nothing remote can run, so the pool
    breaks (one warning) and the job falls back to local workers, rather than staying
    unbroken with no worker."""
    error = ray.exceptions.ActorUnschedulableError("no node matches")
    fake, pool = make_pool(1)
    with pytest.warns(RuntimeWarning, match="ActorUnschedulableError"):
        run_one_each(pool, lambda h: h.fail(error))
    assert pool.broken and "ActorUnschedulableError" in pool.broken
    assert pool.workers == {} and len(fake.handles) == 1


def test_a_draining_worker_that_cannot_be_scheduled_does_not_break_the_pool():
    """Paused (resize(0)), every worker drains: one that then fails to be scheduled is
    just killed, not replaced, and the pool is not broken."""
    error = ray.exceptions.ActorUnschedulableError("its node is gone")
    fake, pool = make_pool(1)
    run_one_each(pool)
    ref = pool.submit(0, [1])
    pool.resize(0)
    (h,) = fake.handles
    h.fail(error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.wait([ref], 0.0)
    assert pool.broken is None and h.killed and pool.workers == {} and len(fake.handles) == 1


def test_once_deaths_used_up_the_replacements_a_scale_up_starts_no_worker():
    """Workers that crash on every task: after max_replace replacements a scale-up must not
    start more of them (one warning says so); the running ones are kept."""
    died = ray.exceptions.ActorDiedError()
    fake, pool = make_pool(1, max_replace=1)
    run_one_each(pool, lambda h: h.fail(died))           # replaced once
    run_one_each(pool)                                   # the replacement runs
    assert pool.replaced == 1 and len(fake.handles) == 2 and pool.size == 1
    run_one_each(pool, lambda h: h.fail(died))           # dies: no replacement left
    assert pool.size == 0 and len(fake.handles) == 2 and pool.broken is None
    with pytest.warns(RuntimeWarning, match="replaced"):
        pool.resize(3)
    assert len(fake.handles) == 2 and pool.size == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # said once
        pool.resize(4)
    assert len(fake.handles) == 2 and pool.size == 0


def test_with_replacements_exhausted_a_scale_up_keeps_the_running_workers():
    """Replacements used up while one worker still runs: resize(3) keeps it and starts none."""
    died = ray.exceptions.ActorDiedError()
    fake, pool = make_pool(2, max_replace=1)
    run_one_each(pool)
    a = fake.handles[0]
    run_one_each(pool, lambda h: h.fail(died) if h is a else h.answer())   # a replaced
    c = fake.handles[2]
    run_one_each(pool, lambda h: h.fail(died) if h is c else h.answer())   # c not replaced
    assert pool.size == 1 and len(fake.handles) == 3
    with pytest.warns(RuntimeWarning, match="replaced"):
        pool.resize(3)
    assert pool.size == 1 and len(fake.handles) == 3 and alive(fake) == [fake.handles[1]]


def test_replacements_left_a_scale_up_starts_workers():
    """A death that was replaced, with replacements left: a scale-up starts workers as asked."""
    died = ray.exceptions.ActorDiedError()
    fake, pool = make_pool(1, max_replace=2)
    run_one_each(pool, lambda h: h.fail(died))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.resize(3)
    assert pool.size == 3 and len(fake.handles) == 4


def test_scaling_back_up_takes_the_draining_workers_back_first():
    """Scaled 3 -> 1 while the drained workers still have queued tasks, then back to 3: the
    two draining workers take tasks again; no new actor waits for their CPUs."""
    fake, pool = make_pool(3)
    run_one_each(pool)
    refs = [pool.submit(0, [i]) for i in range(3)]
    assert None not in refs and {r.handle for r in refs} == set(fake.handles)
    pool.resize(1)
    assert pool.size == 1 and sum(w.draining for w in pool.workers.values()) == 2
    pool.resize(3)
    assert len(fake.handles) == 3 and pool.size == 3 and len(pool.workers) == 3
    assert not any(w.draining for w in pool.workers.values()) and alive(fake) == fake.handles
    for h in fake.handles:
        h.answer()
    assert pool.wait(refs, 0.0) == [] and len(pool.workers) == 3 and alive(fake) == fake.handles


def test_scaling_up_past_the_draining_workers_starts_the_rest():
    """3 -> 1 (two draining) -> 4: both come back and one new worker starts."""
    fake, pool = make_pool(3)
    run_one_each(pool)
    refs = [pool.submit(0, [i]) for i in range(3)]
    pool.resize(1)
    pool.resize(4)
    assert pool.size == 4 and len(fake.handles) == 4 and len(pool.workers) == 4
    assert alive(fake) == fake.handles and not any(w.draining for w in pool.workers.values())
    for h in fake.handles:
        h.answer()
    assert pool.wait(refs, 0.0) == []


def test_the_controller_falls_back_once_no_worker_is_left_to_start():
    """Every worker died and no replacement is left: no remote worker will run again, so
    the controller sets the local workers to fallback_local, as for a broken pool."""
    from manager.policy.autoscale import AutoscaleConfig, Autoscaler
    from preprocess.remote.control import Controller

    fake = FakeRay()
    pool = RemotePool(fake, SimpleNamespace(version=1), max_replace=0)
    local = []
    ctl = Controller(pool, Autoscaler.start(AutoscaleConfig(min_workers=1, max_workers=1)),
                     set_local=local.append, every=1, fallback_local=2)
    stats = SimpleNamespace(batch_times=[0.1], queues=[1.0], batches=1)
    feeder = SimpleNamespace(stats=stats, local_share=0.0)
    ctl(feeder)
    assert not ctl.fell_back and feeder.local_share == 0.0 and local == [0]
    run_one_each(pool, lambda h: h.fail(ray.exceptions.ActorDiedError()))
    assert pool.broken is None and pool.workers == {}
    ctl(feeder)
    assert ctl.fell_back and local == [0, 2] and feeder.local_share == 1.0


def test_a_dead_workers_replacement_no_node_can_take_breaks_the_pool_naming_it():
    """The only node with a CPU for a worker is gone, taking the workers: a replacement
    would pend for ever (Ray gives no error), each holding a task. The pool breaks at the
    first death instead, naming the resource, and starts no replacement."""
    fake, pool = make_pool(2)
    run_one_each(pool)
    fake.nodes = lambda: [{"Alive": False, "Resources": {"CPU": 4.0}}, {"Alive": True, "Resources": {"CPU": 0.5}}]
    with pytest.warns(RuntimeWarning, match="workers lost.*no live node of the Ray cluster .*has CPU: 1 .*CPU: 0.5"):
        run_one_each(pool, lambda h: h.fail(ray.exceptions.ActorDiedError()))
    assert pool.broken and pool.replaced == 0 and len(fake.handles) == 2 and pool.workers == {}


def test_a_node_type_the_autoscaler_can_start_counts_as_placeable():
    """A worker no live node can take is what makes an autoscaling cluster start a node: only
    where no node type of its published config could take it either is it unplaceable."""
    def cluster(groups):
        config = SimpleNamespace(node_group_configs=[SimpleNamespace(resources=r, max_count=n) for r, n in groups])
        return SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}],
                               _private=SimpleNamespace(state=SimpleNamespace(
                                   state=SimpleNamespace(get_cluster_config=lambda: config))))
    check_placeable(cluster([({"CPU": 16.0}, 4)]), {"CPU": 8.0})
    with pytest.raises(Unplaceable, match="CPU: 8"):
        check_placeable(cluster([({"CPU": 16.0}, 0), ({"CPU": 4.0}, -1)]), {"CPU": 8.0})
