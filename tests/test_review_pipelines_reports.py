"""The manager counts a job on its pipeline's transformed set (manager/pipelines.py) only
while the registration that reported the pipeline lasts; these tests run real cache
managers and servers on loopback, with a real CachedDataset's coordinator."""
import contextlib
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.vocab import transformed_tag  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from manager.model import ManagerConfig, ManagerModel  # noqa: E402
from manager.policy.autocache import costs_to_dict  # noqa: E402
from procs import cachemanager, cacheserver, wait_ring, wait_until  # noqa: E402
from test_policy_autocache import costs  # noqa: E402

pytestmark = pytest.mark.timeout(120)
FP = "cd" * 32


def _set(mc: ManagerClient, tag: str) -> dict:
    """A dataset as the job sees it (Status shows a caller its own jobs' datasets); {}: none."""
    return {x["dataset"]: x for x in mc.status_dict()["datasets"]}.get(tag, {})


def _counted(mc: ManagerClient, tag: str) -> bool:
    """Whether a job's gain is on the transformed set (it is not idle)."""
    s = _set(mc, tag)
    return bool(s) and s.get("gain", 0) > 1 and "idle" not in s["reason"] and int(s["allocated_bytes"]) > 0


def _registered(mc: ManagerClient) -> int:
    return len(mc.status_dict()["jobs"])


@contextlib.contextmanager
def _training(coord):
    """Batch times handed to the coordinator, as a training loop does, and its thread
    started: its reports keep the job alive."""
    stop = threading.Event()

    def feed() -> None:
        while not stop.wait(0.05):
            coord.batch_time(time.time(), 0.05)
    t = threading.Thread(target=feed, daemon=True)
    t.start()
    coord.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def test_a_job_registered_again_reports_its_pipelines_again(tmp_path):
    """Before: a job the manager dropped (here its job timeout; a manager restarted on an
    empty state dir alike) registered again on its next report, but loaders report their
    pipeline only once: the manager took the new registration as a run that had not chosen
    the pipeline, so the transformed set the job reads lost its allocation (and, idle, would
    be forgotten under it). The coordinator now reports its pipelines again."""
    from clients.dataset import CachedDataset
    from test_autocache import make_items

    m = cachemanager(str(tmp_path / "mgr"), 0, "--job-timeout-seconds", "1")
    m.start()
    srv = cacheserver(str(tmp_path / "s0"), "1GB", 0, "--manager", m.address).start()
    ds = None
    try:
        wait_ring(m.address, 1)
        ds = CachedDataset(make_items(tmp_path / "ds", n=64, size=4096), manager=m.address, job="job-a")
        coord, tag = ds.coordinator, transformed_tag(ds.dataset_tag, FP)
        d = coord.autocache_decision(ds.dataset_tag, FP, costs(items=64, source_bytes=4096,
                                                                marker_bytes=2048, prefix_s=0.008))
        assert d is not None and d.mode == "transformed", d
        mc = coord.client
        wait_until(lambda: _counted(mc, tag), "the job counted on its set")
        wait_until(lambda: _registered(mc) == 0, "the job expired", timeout=15)
        coord.quiet_report_seconds = coord.report_seconds = 0.2
        with _training(coord):  # its next report: NOT_FOUND, so the job registers again
            wait_until(lambda: _registered(mc) == 1, "the job registered again")
            # before: the set stayed idle ("kept during the grace period after its last job
            # left", then forgotten) and the job's gain went back to its source dataset
            wait_until(lambda: _counted(mc, tag), "the job counted on its set again")
            assert [p["decision"]["jobs"] for p in mc.status_dict()["pipelines"]] == [["job-a"]]
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


def test_a_fixed_job_reported_to_a_real_manager_gets_its_set(tmp_path):
    """End to end (client, RPC, journal): a job fixed at transformed whose pipeline the
    manager decides otherwise. Before: no set (GetPlan of its tag refused), no room."""
    from clients.dataset import CachedDataset
    from test_autocache import make_items

    m = cachemanager(str(tmp_path / "mgr")).start()
    srv = cacheserver(str(tmp_path / "s0"), "1GB", 0, "--manager", m.address).start()
    ds = None
    try:
        wait_ring(m.address, 1)
        ds = CachedDataset(make_items(tmp_path / "ds", n=64, size=4096), manager=m.address, job="job-f")
        coord, tag = ds.coordinator, transformed_tag(ds.dataset_tag, FP)
        d = coord.autocache_decision(ds.dataset_tag, FP, costs(items=64, source_bytes=4096, marker_bytes=2048,
                                                                prefix_s=0.0005), fixed=True)
        assert d is not None and d.mode != "transformed", d
        assert coord.client.get_plan(tag, "job-f").dataset == tag
        wait_until(lambda: _counted(coord.client, tag), "the fixed job counted on the set")
        m.stop()  # the journal keeps it: a manager restarted on the state dir has the set
        m = cachemanager(str(tmp_path / "mgr"), int(m.address.rsplit(":", 1)[1])).start()
        wait_until(lambda: _counted(coord.client, tag), "the fixed job counted after a restart", timeout=15)
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


# ---- a loader fixed at autocache="transformed" (the manager's state machine) ---------
DS = "ab" * 32
MB = 1 << 20


def _model_with_job(*jobs: str) -> ManagerModel:
    m = ManagerModel(ManagerConfig(budget=4000 * MB))
    for t, job in enumerate(jobs):
        m.apply({"type": "job_register", "job": job, "dataset": DS, "dataset_bytes": 2000 * 128 * 1024,
                 "n_items": 2000, "n_gpus": 1, "now": 1.0 + t})
    return m


def _pipeline_event(job: str, now: float, **extra) -> dict:
    d = costs_to_dict(costs(prefix_s=0.0005))  # a cheap prefix: not decided transformed
    d.pop("room_bytes")
    return {"type": "pipeline", "job": job, "dataset": DS, "fingerprint": FP, "costs": d, "now": now, **extra}


def test_a_job_fixed_at_transformed_is_counted_on_the_set_whatever_is_decided():
    """Before: the manager made a transformed set only where its own decision was
    transformed. A loader fixed at autocache="transformed" whose pipeline it decided
    otherwise read and put a set the manager did not know: no plan (GetPlan refused), no
    room, and its gain counted on the source dataset it does not read."""
    m = _model_with_job("fixed", "auto")
    tag = transformed_tag(DS, FP)
    m.apply(_pipeline_event("fixed", 5.0, fixed=True))
    m.apply(_pipeline_event("auto", 6.0))
    rec = m.pipelines[f"{DS}/{FP}"]
    assert rec.mode != "transformed"
    assert tag in m.datasets and m.plan(tag, "fixed")["dataset"] == tag
    gains = m.job_gains()
    assert [g.job_id for g in gains[tag]] == ["fixed"]  # the fixed job reads the set ...
    assert gains[tag][0].benefit == pytest.approx(rec.benefit("transformed")) and rec.benefit("transformed") > 1
    assert [g.job_id for g in gains.get(DS, [])] == ["auto"]  # ... the other follows the decision
    assert m.allocs[tag].bytes > 0
    # a later report of the job without it (the loader now auto) moves its gain back
    m.apply(_pipeline_event("fixed", 7.0))
    assert tag not in m.job_gains()


def test_fixed_reports_are_journaled_and_old_states_load():
    m = _model_with_job("fixed")
    before = ManagerModel.from_dict(m.to_dict())  # a state with pipelines, none fixed
    m.apply(_pipeline_event("fixed", 5.0, fixed=True))
    again = ManagerModel.from_dict(m.to_dict())
    assert again.digest() == m.digest() and again.pipelines[f"{DS}/{FP}"].fixed == ["fixed"]
    # a state written before the field: its pipelines read (and digest) as they were
    old = _model_with_job("fixed")
    old.apply(_pipeline_event("fixed", 5.0))
    d = old.to_dict()
    assert "fixed" not in d["pipelines"][f"{DS}/{FP}"]
    assert ManagerModel.from_dict(d).digest() == old.digest() and before.digest() != m.digest()


def test_a_bad_fixed_value_is_refused_naming_it():
    from manager.model import Rejected

    m = _model_with_job("fixed")
    digest = m.digest()
    with pytest.raises(Rejected, match="fixed must be true or false"):
        m.apply(_pipeline_event("fixed", 5.0, fixed="yes"))
    assert m.digest() == digest
