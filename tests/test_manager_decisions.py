"""The decision loop reconciles servers on its own period, not every round (issue 18:
with the demo's 0.5 s rounds, a Stats call per server per round cost the servers
~0.5 CPU-s per run on a 2-core machine)."""
from __future__ import annotations

import time

import pytest

from manager.decisions import DecisionLoop
from manager.membership import Liveness
from manager.model import ManagerConfig
from manager.state import StateStore


class RecordingActuator:
    """Counts reconcile rounds (the real one calls Stats on every server)."""

    def __init__(self) -> None:
        self.reconciles = 0

    def reconcile(self) -> None:
        self.reconciles += 1


@pytest.fixture
def store(tmp_path):
    s = StateStore(str(tmp_path), ManagerConfig(budget=1_000_000), fsync=False).open()
    yield s
    s.close()


def loop(store, actuator, reconcile_s: float) -> DecisionLoop:
    return DecisionLoop(store, Liveness(time.time()), actuator, interval=0.1, heartbeat_s=0.1, misses=3,
                        job_timeout_s=60.0, reconcile_s=reconcile_s)


def test_rounds_faster_than_the_reconcile_period_reconcile_once_per_period(store):
    act = RecordingActuator()
    d = loop(store, act, reconcile_s=1.0)
    for _ in range(5):  # well within a second
        d.run_once()
    assert (d.runs, act.reconciles) == (5, 1)  # the first round reconciles at once
    time.sleep(1.05)
    d.run_once()
    d.run_once()
    assert (d.runs, act.reconciles) == (7, 2)


def test_a_zero_period_reconciles_every_round(store):
    act = RecordingActuator()
    d = loop(store, act, reconcile_s=0.0)
    for _ in range(3):
        d.run_once()
    assert act.reconciles == 3


def test_a_negative_period_is_refused(store):
    with pytest.raises(ValueError, match="reconcile period"):
        loop(store, RecordingActuator(), reconcile_s=-1.0)


# ------------------------------------------------------------- removals vs registrations (issue: races)

class HookedLiveness(Liveness):
    """Runs a hook once, right after the loop's first scan for dead servers or idle
    jobs: a heartbeat or a job's report landing between the loop's check and its
    removal, deterministically (no threads, no timing)."""

    def __init__(self, started: float) -> None:
        super().__init__(started, restart_grace=0.0)
        self.after_server_scan = self.after_job_scan = None

    def dead_servers(self, *args, **kw):
        out = super().dead_servers(*args, **kw)
        hook, self.after_server_scan = self.after_server_scan, None
        if hook:
            hook()
        return out

    def idle_jobs(self, *args, **kw):
        out = super().idle_jobs(*args, **kw)
        hook, self.after_job_scan = self.after_job_scan, None
        if hook:
            hook()
        return out


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def raced_loop(store, t0: float = 1000.0) -> tuple[DecisionLoop, HookedLiveness, Clock]:
    live, clock = HookedLiveness(t0), Clock(t0)
    d = DecisionLoop(store, live, RecordingActuator(), interval=1.0, heartbeat_s=1.0, misses=3,
                     job_timeout_s=60.0, reconcile_s=1e9, clock=clock)
    return d, live, clock


def register_job(store, live, job: str, now: float) -> None:
    store.submit({"type": "job_register", "job": job, "dataset": "d" * 16, "dataset_bytes": 1000,
                  "n_items": 10, "n_gpus": 1, "now": now})
    live.touch_job(job, now)


def test_a_server_that_heartbeats_after_the_dead_check_stays_in_the_ring(store):
    d, live, clock = raced_loop(store)
    store.submit({"type": "server_join", "server_id": "s1", "address": "h:1", "capacity": 100, "now": 1000.0})
    live.beat("s1", 1000.0)
    clock.t = 1010.0  # silent for 10 s > 3 x 1 s: the scan finds it dead ...
    live.after_server_scan = lambda: live.beat("s1", 1010.0)  # ... and then its heartbeat arrives
    d.run_once()
    assert store.read(lambda m: m.registry.servers["s1"].alive)


def test_a_job_that_reports_after_the_idle_check_is_not_unregistered(store):
    d, live, clock = raced_loop(store)
    register_job(store, live, "j1", 1000.0)
    clock.t = 1100.0  # idle for 100 s > 60 s ...
    live.after_job_scan = lambda: live.touch_job("j1", 1100.0)  # ... then its ReportBatches lands
    d.run_once()
    assert store.read(lambda m: "j1" in m.jobs)


def test_a_job_that_registers_again_right_after_its_expiry_is_not_forgotten(store, monkeypatch):
    """The loop unregisters an idle job; the job registers again before the loop forgets
    its last contact: the new registration's contact must stand."""
    d, live, clock = raced_loop(store)
    register_job(store, live, "j1", 1000.0)
    submit = store.submit

    def submit_then_register_again(ev, **kw):
        out = submit(ev, **kw)
        if ev.get("type") == "job_unregister":
            register_job(store, live, "j1", clock.t)  # RegisterJob, between the removal and the forgetting
        return out

    monkeypatch.setattr(store, "submit", submit_then_register_again)
    clock.t = 1100.0
    d.run_once()
    monkeypatch.setattr(store, "submit", submit)
    assert store.read(lambda m: "j1" in m.jobs)
    clock.t = 1101.0  # 1 s after its new registration: not idle
    d.run_once()
    assert store.read(lambda m: "j1" in m.jobs)


def test_unregister_job_does_not_forget_a_registration_that_came_in_between(store, monkeypatch):
    from cacheserver.counters import Counters
    from cacheserver.proto import manager_pb2 as mpb
    from manager.metrics import MANAGER_COUNTERS
    from manager.service import ManagerService

    live = Liveness(0.0)
    svc = ManagerService(store, live, heartbeat_s=1.0, decision_s=1.0, counters=Counters(MANAGER_COUNTERS),
                         job_timeout_s=60.0)
    register_job(store, live, "j1", 1000.0)
    submit = store.submit

    def submit_then_register_again(ev, **kw):
        out = submit(ev, **kw)
        if ev.get("type") == "job_unregister":
            register_job(store, live, "j1", 1001.0)  # another RegisterJob of the same name
        return out

    monkeypatch.setattr(store, "submit", submit_then_register_again)
    svc.UnregisterJob(mpb.UnregisterJobRequest(job="j1"), None)
    assert store.read(lambda m: "j1" in m.jobs)
    assert live.idle_jobs(["j1"], 1002.0, 60.0) == []  # its new contact stands
