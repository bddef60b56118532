"""preprocess/pool.py with real spawned workers: a worker stopped by a shrink stays
until the scheduler has taken what it sent (tensors come through shared memory, which
the scheduler can only fetch from a living process)."""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.pool import WorkerPool  # noqa: E402
from preprocess_steps import KillOn, as_tensor, index_of  # noqa: E402
from test_preprocess_worker_failures import Misbehave  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_a_shrunk_workers_tensors_are_taken_after_it_was_told_to_stop(tmp_path):
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False)
    pipeline = Pipeline([index_of, as_tensor])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    try:
        pool.resize(2)
        pool.send(1, ("task", 7, 0, pipeline.order, None, [(3, False), (5, False)]))
        pool.resize(1)                          # worker 1 stops after its task
        victim = pool.procs[1]
        victim.join(5)                          # it has sent all; nothing read yet
        got, deadline = [], time.monotonic() + 30
        while not any(m[0] == "exit" for m in got) and time.monotonic() < deadline:
            got += pool.receive(0.1)
        done = {m[3]: m[4].tolist() for m in got if m[0] == "done"}
        assert done == {3: [3] * 4, 5: [5] * 4} and got[-1] == ("exit", 1, None)
        pool.exited(1)
        assert victim.exitcode == 0 and 1 not in pool.results and pool.size == 1
    finally:
        pool.close()
        ds.close()


@pytest.mark.parametrize("exit_status", [-signal.SIGKILL, 0])
def test_a_killed_workers_message_whose_tensor_went_with_it_is_dropped(tmp_path, exit_status):
    """Its item is held by the dead worker and so re-run (dead()), never an error; a worker
    that exits with status 0 without saying so (os._exit(0) in a step) is as dead."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False)
    stop = KillOn({5}) if exit_status else Misbehave("exit0", {5})
    pipeline = Pipeline([index_of, stop, as_tensor])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    try:
        pool.resize(1)
        victim = pool.procs[0]
        pool.send(0, ("task", 7, 0, pipeline.order, None, [(3, False), (5, False)]))  # 3 sent, then gone on 5
        victim.join(30)
        assert victim.exitcode == exit_status
        got = []
        for _ in range(5):
            got += pool.receive(0.1)
        assert got == [] and pool.dead() == [0]
    finally:
        pool.close()
        ds.close()


def test_the_scheduler_counts_its_cpu_reading_the_workers_outputs(tmp_path):
    """The hand-off as the epochs run it (clients/automeasure.handoff_seen): items counted
    once each, and 1 MiB outputs cost the scheduler's thread more than small ones."""
    from clients.automeasure import MIN_HANDOFFS, handoff_seen
    from preprocess_steps import inflate_mib

    ds = CachedDataset(indexed_items(tmp_path / "ds", 40), cache=False)
    per_item = {}
    for name, steps in (("small", [index_of]), ("large", [index_of, inflate_mib])):
        pipeline = Pipeline(steps)
        pool = WorkerPool(ds, pipeline, job_seed=0)
        try:
            pool.resize(1)
            assert handoff_seen(0.5, pool) == 0.5                  # nothing read yet: the probe's
            pool.send(0, ("task", 7, 0, pipeline.order, None, [(i, False) for i in range(40)]))
            done, deadline = 0, time.monotonic() + 60
            while done < 40 and time.monotonic() < deadline:
                done += sum(1 for m in pool.receive(0.1) if m[0] == "done")
            assert done == 40 and pool.handoff_items == 40 and pool.handoff_cpu_s > 0
            per_item[name] = pool.handoff_cpu_s / pool.handoff_items
            assert 40 >= MIN_HANDOFFS and handoff_seen(0.0, pool) == per_item[name]
            assert handoff_seen(1.0, pool) == 1.0                  # the larger of the two
        finally:
            pool.close()
    ds.close()
    assert per_item["large"] > 2 * per_item["small"], per_item
