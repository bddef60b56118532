"""The cache manager's side of remote preprocessing workers: `cachemanager --ray`
handed to jobs, and each job's scaling policy run in the manager (ScaleWorkers).
Unit tests of manager/workers.py, then a real cachemanager process; the loader's
remote='auto' without a cluster runs local workers with one warning."""
import os
import subprocess
import sys
import warnings

import grpc
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from manager.manager_client import ManagerClient, ManagerError  # noqa: E402
from manager.managerd import _scaling  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from manager.policy.placement import PlacementConfig  # noqa: E402
from manager.policy.scaling import Measurement  # noqa: E402
from manager.workers import WorkerScaling  # noqa: E402
from procs import ROOT, cachemanager, manager_with_server  # noqa: E402

pytestmark = pytest.mark.timeout(180)
DATASET = "ab" * 16


def test_a_first_call_starts_the_policy_and_measurements_drive_it():
    s = WorkerScaling("ray://head:10001", AutoscaleConfig(settle=0))
    assert s.ray_address == "ray://head:10001"
    first = s.decide("j", "autoscale", None)
    assert (first.remote, first.local, first.reason, first.phase) == (1, 0, "", "ramping")
    got = [s.decide("j", "autoscale", Measurement(bt)) for bt in (0.4, 0.2, 0.195, 0.2)]
    # the ramp: 2 doubled, 4 did not help: 2 and its headroom, measured there to converge
    assert [c.remote for c in got] == [2, 4, 3, 3]
    assert got[2].phase == "settling" and "threshold" in got[2].reason
    assert got[-1].phase == "converged"
    assert s.decide("j", "autoscale", None).remote == 1             # a new start: a fresh policy


def test_placement_runs_for_remote_and_local_workers():
    s = WorkerScaling(None, placement=PlacementConfig(settle=0))
    first = s.decide("j", "placement", None)
    assert s.ray_address == "" and (first.remote, first.local) == (1, 0)
    for bt in (0.2, 0.1, 0.1):                                      # remote plateau at 2 (no headroom in placement)
        c = s.decide("j", "placement", Measurement(bt))
    c = s.decide("j", "placement", Measurement(0.1))                 # then a local worker
    assert (c.remote, c.local, c.phase) == (2, 1, "add_local")


def test_a_policy_unknown_here_starts_from_the_jobs_counts():
    """No policy in memory nor journaled (none attached here): on from the job's counts."""
    s = WorkerScaling(autoscale=AutoscaleConfig(settle=0))
    c = s.decide("j", "autoscale", Measurement(0.1), remote=12, local=0)   # no policy known
    assert c.remote == 13 and c.phase == "ramping"                  # on from 12, not from 1
    p = WorkerScaling(placement=PlacementConfig(settle=0)).decide("j", "placement", Measurement(0.1), 3, 2)
    assert (p.remote, p.local) == (4, 2)


def test_a_window_measured_at_counts_the_policy_did_not_choose_is_dropped():
    """An answer the job did not get (its 1 s deadline passed while the manager journaled
    the change) leaves it on its old counts: the window it measures there is not the
    new count's, so it is dropped and the policy's counts are answered again. Counts
    (0, 0) are a caller that reports none: its windows count."""
    s = WorkerScaling(autoscale=AutoscaleConfig(settle=0))
    s.decide("j", "autoscale", None)
    assert s.decide("j", "autoscale", Measurement(0.4), 1, 0).remote == 2    # this answer is lost
    c = s.decide("j", "autoscale", Measurement(0.4), 1, 0)                   # still on 1
    assert (c.remote, c.reason, c.phase) == (2, "", "ramping")               # not "2 did not help"
    c = s.decide("j", "autoscale", Measurement(0.2), 2, 0)
    assert c.remote == 4 and "linear" in c.reason
    assert s.decide("j", "autoscale", Measurement(0.1)).remote == 8          # no counts reported


def test_a_placement_restarted_from_the_jobs_counts_climbs_as_configured():
    """The ramp (the default), not Cachew's one-at-a-time rule: 3 -> 4 brought its
    expected gain (linear), so the step doubles to 6; with climb="cachew", 5."""
    for climb, after in (("ramp", 6), ("cachew", 5)):
        s = WorkerScaling(placement=PlacementConfig(settle=0, climb=climb))
        s.decide("j", "placement", Measurement(0.4), remote=3, local=0)          # restarted: on from 3
        c = s.decide("j", "placement", Measurement(0.3))                         # 4 workers: 0.4 x 3 / 4
        assert (c.remote, c.phase) == (after, "remote"), climb
    only_local = WorkerScaling(placement=PlacementConfig(settle=0, min_remote=0))
    c = only_local.decide("j", "placement", Measurement(0.4), remote=0, local=2)  # 0 remote: allowed
    assert (c.remote, c.local) == (1, 2)


def test_forgotten_jobs_and_bad_input():
    s = WorkerScaling()
    s.decide("a", "autoscale", None)
    s.decide("b", "autoscale", None)
    s.forget_except(["b"])
    assert set(s.jobs) == {"b"}
    with pytest.raises(ValueError, match="policy must be one of"):
        s.decide("a", "hpa", None)
    for bad in ("10.0.0.1:10001", "ray://host"):
        with pytest.raises(ValueError, match="ray://HOST:PORT"):
            WorkerScaling(bad)


def test_a_real_manager_gives_its_ray_address_and_runs_the_jobs_policy(tmp_path):
    m = cachemanager(str(tmp_path / "mgr"), 0, "--ray", "ray://127.0.0.1:10001").start()
    try:
        with ManagerClient(m.address, timeout=10) as mc:
            with pytest.raises(ManagerError, match="unknown job") as e:
                mc.scale_workers("nobody", "autoscale")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            mc.register_job("job-a", DATASET, 10**6, 100)
            first = mc.scale_workers("job-a", "autoscale")
            assert first.ray_address == "ray://127.0.0.1:10001" and (first.remote, first.local) == (1, 0)
            # the default settle (1) drops the measurement after each change
            counts = [mc.scale_workers("job-a", "autoscale", Measurement(bt), 0, 0).remote
                      for bt in (0.4, 0.4, 0.2, 0.2, 0.199)]
            assert counts == [2, 2, 4, 4, 3]          # the ramp: 2 doubled, 4 did not help: 2 + 1
            with pytest.raises(ManagerError, match="policy must be one of") as e:
                mc.scale_workers("job-a", "fixed")
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(ManagerError, match="finite and >= 0") as e:   # never into the journal
                mc.scale_workers("job-a", "autoscale", Measurement(0.1, float("inf")), 2, 0)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        m.stop()


def test_after_kill_9_a_real_manager_continues_each_jobs_policy_where_it_was(tmp_path):
    """The policies are journaled: after kill -9 and a new manager on the same state
    directory, the next measurement continues them (phase, counts, plateau) instead
    of starting again from the counts the jobs report. A snapshot every 4 events, so
    the state comes back from a snapshot and a journal tail."""
    state = str(tmp_path / "mgr")
    m = cachemanager(state, 0, "--snapshot-every", "4").start()
    try:
        with ManagerClient(m.address, timeout=10) as mc:
            for job in ("scaled", "placed"):
                mc.register_job(job, DATASET, 10**6, 100)
                mc.scale_workers(job, "autoscale" if job == "scaled" else "placement")
            counts = [mc.scale_workers("scaled", "autoscale", Measurement(bt)).remote
                      for bt in (0.4, 0.4, 0.2, 0.2, 0.199, 0.2, 0.2)]   # settle 1: every other window dropped
            assert counts == [2, 2, 4, 4, 3, 3, 3]                # plateau from 2: settled on 3, plateau 0.2
            placed = [mc.scale_workers("placed", "placement", Measurement(bt))
                      for bt in (0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1)]
            assert [(c.remote, c.local) for c in placed] == [(2, 0), (2, 0), (4, 0), (4, 0), (2, 0), (2, 0), (2, 1)]
            assert placed[-1].phase == "add_local"
            tokens = {job: mc.job_token(job) for job in ("scaled", "placed")}
    finally:
        m.proc.kill()                                             # kill -9: no snapshot at exit
        m.proc.wait()
    m2 = cachemanager(state, 0, "--snapshot-every", "4").start()
    try:
        with ManagerClient(m2.address, timeout=10) as mc:
            for job, token in tokens.items():
                mc.set_job_token(job, token)
            # converged on a window with no change, so no settle window: ten make a re-check
            got = [mc.scale_workers("scaled", "autoscale", Measurement(0.2), 3, 0) for _ in range(10)]
            assert {(c.remote, c.phase, c.reason) for c in got} == {(3, "converged", "")}  # not ramping from 3
            for _ in range(10):                                   # the re-check's mean above the plateau
                c = mc.scale_workers("scaled", "autoscale", Measurement(0.3), 3, 0)
            assert (c.remote, c.phase) == (4, "ramping") and "degraded" in c.reason
            mc.scale_workers("placed", "placement", Measurement(0.1), 2, 1)   # the settle window
            c = mc.scale_workers("placed", "placement", Measurement(0.1), 2, 1)
            assert (c.remote, c.local, c.phase) == (1, 1, "trim")  # the local worker kept batch time
    finally:
        m2.stop()


def test_manager_refuses_a_malformed_ray_address(tmp_path):
    r = subprocess.run([sys.executable, "-m", "manager.managerd", "--listen", "127.0.0.1:0", "--state-dir",
                        str(tmp_path / "st"), "--ray", "10.0.0.1:10001"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--ray '10.0.0.1:10001'" in r.stderr and "ray://HOST:PORT" in r.stderr


@pytest.mark.parametrize("flag", ["--decision-seconds", "--job-timeout-seconds"])
def test_manager_refuses_a_nan_interval(tmp_path, flag):
    from manager.managerd import build_parser, config_from_args

    args = build_parser().parse_args(["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), flag, "nan"])
    with pytest.raises(ValueError, match=f"{flag} must be"):
        config_from_args(args)


def test_remote_auto_without_a_cluster_runs_local_workers_with_one_warning(tmp_path, monkeypatch):
    from clients.dataset import CachedDataset
    from preprocess import Pipeline
    from remote_steps import Jitter, decode
    from test_preprocess_loader import indexed_items

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    n = 24
    with manager_with_server(str(tmp_path)) as (m, _):  # no --ray
        ds = CachedDataset(indexed_items(tmp_path / "ds", n), manager=m.address, job="auto-local",
                           transform=Pipeline([decode, Jitter()]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = ds.loader(8, num_workers=1, cost_dir=False, remote="auto")
        try:
            said = [str(w.message) for w in caught if "Ray cluster" in str(w.message)]
            assert len(said) == 1 and "knows none (cachemanager --ray)" in said[0]
            assert "local workers only" in said[0] and loader.remote is None
            assert sum(len(b) for b in loader) == n and sorted(loader.preprocess.yielded()) == list(range(n))
        finally:
            loader.close()
            ds.close()


def test_policy_config_takes_headroom_and_linear_share_and_names_a_key_that_is_gone():
    s = _scaling(None, {"autoscale": {"headroom": 0, "linear_share": 0.8},
                        "placement": {"headroom": 2, "linear_share": 0.7}})
    assert (s.autoscale.headroom, s.autoscale.linear_share, s.placement.autoscale().headroom,
            s.placement.autoscale().linear_share) == (0, 0.8, 2, 0.7)
    with pytest.raises(ValueError, match="linear_slack was replaced by linear_share"):
        _scaling(None, {"autoscale": {"linear_slack": 0.03}})
    for section in ("autoscale", "placement"):  # placement's phase-1 settings are checked at start-up too
        with pytest.raises(ValueError, match="headroom must be a whole number >= 0"):
            _scaling(None, {section: {"headroom": -1}})
        with pytest.raises(ValueError, match="headroom must be a whole number >= 0"):
            _scaling(None, {section: {"headroom": 1.5}})
