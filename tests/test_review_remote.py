"""Review of the remote workers (preprocess/remote) on a real Ray head (loopback) and a
real cacheserver: the Ray Client connection start() makes is shared by the pools that
use it and left by the last one (a user's is never closed); an option refused after
connecting leaves no connection behind; a worker that cannot load the job's pipeline
says why in the task-failure warning."""
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.remote import start  # noqa: E402
from rayhead import disconnect, started  # noqa: E402
from remote_steps import Jitter, Slow, decode  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_pool_deaths import dies  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)
ONE = dict(autoscale=AutoscaleConfig(min_workers=1, max_workers=1))


@pytest.fixture
def head(shared_head):
    """The pytest process's shared Ray head (conftest), idle as this module began."""
    return shared_head


def client_only_pipeline(tmp_path):
    """A pipeline with a step whose module only this process can import (the Ray workers
    cannot load it: their tasks fail)."""
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "rv_client_only_steps.py").write_text(
        "class Twice:\n    def __call__(self, x):\n        return x * 2\n")
    sys.path.insert(0, str(tmp_path / "mod"))  # here only: not on the workers' path
    try:
        from rv_client_only_steps import Twice
    finally:
        sys.path.remove(str(tmp_path / "mod"))
    return Pipeline([decode, Twice(), Jitter()])


def _refuse(n):
    raise RuntimeError(f"set_local({n}) refused")


def test_the_connection_is_shared_by_the_pools_and_left_by_the_last(head, module_server, tmp_path):
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = CachedDataset(indexed_items(tmp_path / "ds", 16), cache=module_server.address, job="rv-share", transform=pipe)
    a = b = None
    try:
        # an option refused once connected (or the caller's set_local raising once workers
        # started) leaves no connection, so no worker, behind
        with pytest.raises(ValueError, match="window >= 1"):
            start(ds, pipe, 0, head.address, window=0, **ONE)
        assert not ray.is_initialized()
        with pytest.raises(RuntimeError, match="refused"):
            start(ds, pipe, 0, head.address, set_local=_refuse)
        assert not ray.is_initialized()
        # two loaders' pools on one connection: the first closed leaves the other working
        a = started(ds, pipe, head.address, **ONE)
        b = started(ds, pipe, head.address, **ONE)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "remote preprocessing workers lost" would raise
            a.close()
            ref = b.pool.submit(0, [0, 1, 2])
            assert ref is not None and b.pool.wait([ref], 60.0) == []
        assert b.pool.broken is None and b.pool.counts.made == 3 and ray.is_initialized()
        b.close()
        assert not ray.is_initialized()                 # the last one left it
        # the user's own connection: used, never closed, not even by a refused start
        head.connect()
        with pytest.raises(ValueError, match="window >= 1"):
            start(ds, pipe, 0, head.address, window=0, **ONE)
        rw = started(ds, pipe, head.address, **ONE)
        assert rw.pool.share is None
        rw.close()
        assert ray.is_initialized()
    finally:
        for rw in (a, b):
            if rw is not None:
                rw.close()
        disconnect(ray)
        ds.close()


def test_a_worker_that_cannot_load_the_pipeline_says_why(head, module_server, tmp_path):
    """A step whose module the Ray workers cannot import: the tasks fail (the trainer makes
    their items) and the warning names the import error, not just a spec mismatch."""
    pipe = client_only_pipeline(tmp_path)
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=module_server.address, job="rv-import", transform=pipe)
    rw = started(ds, pipe, head.address, **ONE)  # before try: nothing to close where it fails
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = rw.pool.submit(0, [0, 1])
            assert ref is not None and rw.pool.wait([ref], 60.0) == []
        assert rw.pool.counts.failed == 2 and rw.pool.counts.made == 0 and rw.pool.broken is None
        text = " ".join(str(w.message) for w in caught if "task failed" in str(w.message))
        assert "No module named 'rv_client_only_steps'" in text, text
    finally:
        rw.close()
        ds.close()
        sys.modules.pop("rv_client_only_steps", None)


def test_a_break_while_settling_finished_tasks_loses_the_rest_without_raising(head, module_server, tmp_path):
    """Two workers die with tasks queued and the cluster goes as the pool starts a
    replacement: the first settled task breaks the pool, and the other finished tasks
    (cleared by the break) are counted lost, not a KeyError into the trainer."""
    # 10 s an item: no task may finish before Ray's kill (asynchronous) lands, on a loaded host
    # too; a killed worker's tasks end at once, so the test does not wait for them
    pipe = Pipeline([decode, Slow(10.0), Jitter()])
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=module_server.address, job="rv-break", transform=pipe)
    rw = started(ds, pipe, head.address, autoscale=AutoscaleConfig(min_workers=2, max_workers=2))
    try:
        pool = rw.pool
        refs = [pool.submit(0, [0, 1, 2]), pool.submit(0, [3, 4, 5])]
        assert None not in refs and len({t.wid for t in pool.tasks.values()}) == 2  # one task on each
        for w in list(pool.workers.values()):
            ray.kill(w.handle)  # both worker processes die with their tasks queued

        def gone():
            raise ConnectionError("the cluster went away")
        pool._start = gone  # the replacement's start is where the lost cluster shows
        with pytest.warns(RuntimeWarning, match="remote preprocessing workers lost.*went away"):
            assert pool.wait(refs, 60.0) == []
        assert pool.broken and pool.tasks == {} and pool.counts.lost == 6 and pool.counts.made == 0
    finally:
        rw.close()
        ds.close()


def test_a_drained_worker_whose_last_task_failed_is_stopped(head, module_server, tmp_path):
    """A worker removed by scaling is killed once its queued tasks are done, failed
    ones too: else it holds its CPU in the cluster until the pool closes."""
    pipe = Pipeline([decode, Jitter()])
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=module_server.address, job="rv-drain", transform=pipe)
    rw = started(ds, pipe, head.address, autoscale=AutoscaleConfig(min_workers=2, max_workers=2))
    try:
        pool = rw.pool
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the task-failure warning: the test above
            # both answered a task: a worker still starting is stopped at once, not drained
            warmup = [pool.submit(0, [4, 5]), pool.submit(0, [6, 7])]
            assert None not in warmup and pool.wait(warmup, 90.0) == []
            # items the dataset does not have: the runner raises (a failed task, the worker
            # kept: unlike a spec it cannot take, which has it replaced)
            refs = [pool.submit(0, [100, 101]), pool.submit(0, [102, 103])]
            assert None not in refs and len({t.wid for t in pool.tasks.values()}) == 2
            pool.resize(1)  # one of the two, its task queued, drains
            drained = [w.handle for w in pool.workers.values() if w.draining]
            assert len(drained) == 1 and pool.size == 1
            assert pool.wait(refs, 60.0) == []
        assert pool.counts.failed == 4 and pool.broken is None
        assert [w.draining for w in pool.workers.values()] == [False]  # the drained one is gone
        assert dies(drained[0])  # and its process was killed (Ray's kill lands a moment later)
    finally:
        rw.close()
        ds.close()
