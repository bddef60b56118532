"""Review of the remote pool's unfinished tasks and useless workers (preprocess/remote/pool.py,
control.py) on a real Ray head (loopback) and a real cacheserver:

* close() dropped the unfinished tasks without counting their items in `lost`: a job's
  summary said every item sent remote was made, present or failed, none lost.
* A worker that cannot take the job's spec (a step's module not installed on its node)
  fails each task at once; answering fast, it was the least loaded and took the most tasks,
  never replaced: every task sent there was wasted. It is now dropped as a dead one (replaced
  while replacements are left, then none is started).
* pause() drained the workers, but those with queued tasks ran on (holding their CPUs, making
  items keyed where the trainer does not look) until a later wait or poll settled their tasks.
"""
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from rayhead import started  # noqa: E402
from remote_steps import Jitter, Slow, decode  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_pool_deaths import dies, is_dead, warm  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)
ONE = dict(autoscale=AutoscaleConfig(min_workers=1, max_workers=1))


@pytest.fixture
def head(shared_head):
    """The pytest process's shared Ray head (conftest), idle as this module began."""
    return shared_head


def dataset(tmp_path, job, pipe, server, n=32):
    return CachedDataset(indexed_items(tmp_path / "ds", n), cache=server.address, job=job, transform=pipe)


def test_close_counts_the_items_of_unfinished_tasks_lost(head, module_server, tmp_path):
    pipe = Pipeline([decode, Slow(0.5), Jitter()])
    ds = dataset(tmp_path, "pc-close", pipe, module_server)
    rw = started(ds, pipe, head.address, **ONE)
    try:
        pool = rw.pool
        warm(pool)
        refs = [pool.submit(0, list(range(k, k + 3))) for k in (4, 7)]  # 3 s of work: unfinished at close
        assert None not in refs
    finally:
        rw.close()
        ds.close()
    c = pool.counts
    assert c.items == 7 and c.made + c.present + c.failed == 1
    assert c.lost == 6, f"close dropped 6 items' tasks, counted {c.lost} lost"


def driver_only_step(tmp_path):
    """A step whose module this process imports and the cluster's workers cannot (not installed
    on their nodes): a worker fails to take the spec (configure), and refuses each task."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "driver_only_steps.py").write_text(textwrap.dedent("""
        class Double:
            def __call__(self, x):
                return x * 2
    """))
    sys.path.insert(0, str(tmp_path / "mods"))
    try:
        import driver_only_steps
    finally:
        sys.path.remove(str(tmp_path / "mods"))
    return driver_only_steps.Double()


def test_a_worker_that_cannot_take_the_spec_is_given_no_more_tasks(head, module_server, tmp_path):
    pipe = Pipeline([decode, driver_only_step(tmp_path), Jitter()])
    ds = dataset(tmp_path, "pc-refused", pipe, module_server)
    rw = started(ds, pipe, head.address, **ONE)
    try:
        pool = rw.pool
        pool.max_replace = 1  # one replacement, refused alike
        sent = 0
        with pytest.warns(RuntimeWarning, match="could not take spec version 1"):
            for k in range(0, 24, 3):  # one at a time: a starting worker takes one task
                ref = pool.submit(0, list(range(k, k + 3)))
                if ref is None:
                    continue
                sent += 1
                assert pool.wait([ref], 90.0) == []
        c = pool.counts
        assert c.failed == 3 * sent and c.made == 0 and pool.broken is None
        assert sent == 2, f"{sent} tasks went to workers that refuse every one"
        assert pool.workers == {} and pool.exhausted and c.deaths == 2
    finally:
        rw.close()
        ds.close()


def test_pause_stops_the_workers_with_queued_tasks_at_once(head, module_server, tmp_path):
    pipe = Pipeline([decode, Slow(0.5), Jitter()])
    ds = dataset(tmp_path, "pc-pause", pipe, module_server)
    rw = started(ds, pipe, head.address, **ONE)
    try:
        pool = rw.pool
        warm(pool)
        (w,) = pool.workers.values()
        refs = [pool.submit(0, list(range(k, k + 3))) for k in (4, 7, 10)]  # 4.5 s of work queued
        assert None not in refs
        rw.controller.pause()
        assert pool.workers == {} and pool.tasks == {}, "a paused pool's worker runs on its queued tasks"
        assert dies(w.handle)  # Ray's kill lands a moment after the call
        assert pool.counts.lost == 9 and pool.broken is None
        rw.controller.resume()  # back to the policy's count: a worker is started again
        assert pool.size == 1 and not is_dead(next(iter(pool.workers.values())).handle)
    finally:
        rw.close()
        ds.close()
