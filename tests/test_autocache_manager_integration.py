"""Autocache through a real cachemanager and real cacheservers on loopback: jobs
report their pipeline costs (JobCoordinator.autocache_decision), the manager
decides once per (dataset, pipeline), journals it (the decision survives kill -9),
allocates the transformed set, and `cachectl status` shows the decision and why."""
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from cacheserver.vocab import transformed_tag  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from manager.policy.autocache import decide  # noqa: E402
from procs import ROOT, cachemanager, cacheserver, wait_ring  # noqa: E402
from test_dataset import make_dataset  # noqa: E402
from test_policy_autocache import costs  # noqa: E402

FP = "5e" * 32


def test_jobs_share_the_managers_decision_and_it_survives_a_restart(tmp_path):
    state = str(tmp_path / "mgr")
    m = cachemanager(state).start()
    srv = cacheserver(str(tmp_path / "s0"), "1GB", 0, "--manager", m.address).start()
    path, _ = make_dataset(tmp_path / "ds", n=120)
    a = b = None
    try:
        wait_ring(m.address, 1)
        a = CachedDataset(path, manager=m.address, job="job-a")
        b = CachedDataset(path, manager=m.address, job="job-b")
        heavy = costs(items=120, prefix_s=0.008, epoch_done=0.25, source_cached=0.25, transformed_cached=0.0)
        d1 = a.coordinator.autocache_decision(a.dataset_tag, FP, heavy)
        assert d1 is not None and d1.mode == "transformed" == decide(heavy).mode
        assert set(d1.costs) == {"compute", "source", "transformed"} and "prefix 8" in d1.reason
        # job-b measured no CPU at all: alone it would compute, but the pipeline is decided
        light = costs(items=120, prefix_s=0.0, store_read_s=0.0003)
        assert decide(light).mode == "compute"
        d2 = b.coordinator.autocache_decision(b.dataset_tag, FP, light)
        assert d2 == d1
        # cachectl status: the decision, the projections and the measured costs behind them
        r = subprocess.run([sys.executable, "-m", "manager.ctl", "status", "--manager", m.address],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "AUTOCACHE" in r.stdout and "transformed" in r.stdout
        assert d1.reason in r.stdout
        with ManagerClient(m.address, timeout=2) as mc:
            st = mc.status_dict()
        p = st["pipelines"][0]
        assert p["decision"]["mode"] == "transformed" and sorted(p["decision"]["jobs"]) == ["job-a", "job-b"]
        assert p["measured"]["prefix_s"] == pytest.approx(0.004)  # item-weighted mean of the two jobs
        assert p["measured"]["epoch_done"] == pytest.approx(0.625)  # mean of 0.25 and job-b's 1.0
        tag = transformed_tag(a.dataset_tag, FP)
        ds = {x["dataset"]: x for x in st["datasets"]}
        assert tag in ds and int(ds[tag]["allocated_bytes"]) > 0      # its bytes count in allocation
        # kill -9 and restart on the same state directory: the decision is still there
        port = int(m.address.rsplit(":", 1)[1])
        m.kill()
        m = cachemanager(state, port).start()
        with ManagerClient(m.address, timeout=2) as mc:
            st2 = mc.status_dict()
        assert st2["pipelines"][0]["decision"] == p["decision"]
        assert st2["state_digest"] == st["state_digest"] or st2["journal_seq"] >= st["journal_seq"]
        d3 = a.coordinator.autocache_decision(a.dataset_tag, FP, heavy)  # job-a reports again
        assert d3 == d1
        # job-b measures again, reading 8x outputs back at 30 ms each: on both jobs' measurements
        # transformed is far dearer than the alternatives -- decided again, journaled, shown
        far = costs(items=120, prefix_s=0.0, marker_bytes=8 * 128 * 1024, cache_read_marker_s=0.03)
        d4 = b.coordinator.autocache_decision(b.dataset_tag, FP, far)
        assert d4.mode != "transformed" and d4.reason.startswith("re-decided, was transformed")
        r = subprocess.run([sys.executable, "-m", "manager.ctl", "status", "--manager", m.address],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "re-decided, was transformed" in r.stdout, r.stdout + r.stderr
        m.kill()
        m = cachemanager(state, port).start()
        with ManagerClient(m.address, timeout=2) as mc:
            assert mc.status_dict()["pipelines"][0]["decision"]["reason"] == d4.reason
    finally:
        for x in (a, b):
            if x is not None:
                x.close()
        srv.kill()
        m.kill()


def test_no_manager_means_the_job_decides_alone(tmp_path):
    m = cachemanager(str(tmp_path / "mgr")).start()
    srv = cacheserver(str(tmp_path / "s0"), "256MB", 0, "--manager", m.address).start()
    path, _ = make_dataset(tmp_path / "ds", n=50)
    ds = None
    try:
        wait_ring(m.address, 1)
        ds = CachedDataset(path, manager=m.address, job="job-c")
        m.kill()
        t0 = time.monotonic()
        assert ds.coordinator.autocache_decision(ds.dataset_tag, FP, costs(items=50)) is None
        assert time.monotonic() - t0 < 10
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


def test_bad_reports_are_refused_with_the_reason(tmp_path):
    m = cachemanager(str(tmp_path / "mgr")).start()
    try:
        with ManagerClient(m.address, timeout=2) as mc:
            mc.register_job("j", "ab" * 32, 1000, 10)
            from manager.manager_client import ManagerError
            with pytest.raises(ManagerError, match="fingerprint"):
                mc.report_pipeline("j", "ab" * 32, "not-hex", costs(items=10))
            with pytest.raises(ManagerError, match="unknown job"):
                mc.report_pipeline("ghost", "ab" * 32, FP, costs(items=10))
            # no server: a budget of 0 bytes, so nothing can be cached, whatever the costs
            d = mc.report_pipeline("j", "ab" * 32, FP, costs(items=10, prefix_s=0.008))
            assert d.mode == "compute" and "room 0 MB holds 0% transformed, 0% source" in d.reason
    finally:
        m.kill()
