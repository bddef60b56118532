"""Autocache review (second pass): real cache servers, a real cachemanager, real files."""
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from autocache_steps import Slow, as_array, noise, shrink, total  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from preprocess import Pipeline, autocache, step  # noqa: E402
from procs import cachemanager, cacheserver, wait_ring  # noqa: E402
from test_autocache import make_items, wait_kept  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N = 96


def _run_once(path, m):
    """One loader of job-m ("auto"), one epoch, its transformed items all put; closed."""
    p = Pipeline([as_array, Slow(0.01), shrink, autocache, step(noise, random=True), total])
    ds = CachedDataset(path, manager=m.address, job="job-m", transform=p)
    lo = ds.loader(8, num_workers=0, seed=3, autocache="auto", epochs=5, cost_dir=False)
    try:
        assert sum(len(b) for b in lo) == N
        wait_kept(ds, lo, N)
        with ManagerClient(m.address, timeout=2) as mc:
            rows = {x["dataset"]: x for x in mc.status_dict()["datasets"]}
        return lo.autocache.state, lo.autocache.mode, rows[lo.autocache.transformed().tag]
    finally:
        lo.close()
        ds.close()


def test_a_job_run_again_that_finds_its_set_keeps_it_with_the_manager(tmp_path):
    """Before: a job registered again under its name (a restart) found the transformed items
    of its pipeline and read them, but never reported the pipeline; the manager counts a job
    on a transformed set only once it reports it, so the set went idle under the running
    job (gain 0, its grace period started) and would be dropped, every item a miss then."""
    m = cachemanager(str(tmp_path / "mgr")).start()
    srv = cacheserver(str(tmp_path / "s0"), "1GB", 0, "--manager", m.address).start()
    try:
        wait_ring(m.address, 1)
        path = make_items(tmp_path / "ds", n=N, size=4096)
        state, mode, row = _run_once(path, m)
        assert (state, mode) == ("estimated", "transformed") and row["gain"] > 0
        state, mode, row = _run_once(path, m)  # the same job again
        assert (state, mode) == ("found", "transformed")
        assert row["gain"] > 0 and "idle" not in row["reason"], row["reason"]
    finally:
        srv.kill()
        m.kill()
