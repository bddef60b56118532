"""A step of the wall clock (NTP, a resumed VM) must not drop every live server and job:
the manager's journaled times are wall-clock, but heartbeat ages are measured against a
monotonic clock. Before, a forward step past --heartbeat-seconds x misses made every
server leave the ring in the next decision round (budget 0: every dataset evicted), and
one past --job-timeout-seconds unregistered every job."""
from __future__ import annotations

import time
import types

import manager.managerd as managerd
from manager.managerd import DaemonConfig, ManagerDaemon
from manager.membership import Liveness, Registry
from manager.model import ManagerConfig


class SteppingWallClock(types.SimpleNamespace):
    """``time`` as managerd sees it: real monotonic time, a wall clock that can step."""

    def __init__(self) -> None:
        super().__init__(monotonic=time.monotonic, sleep=time.sleep)
        self.step = 0.0

    def time(self) -> float:
        return time.time() + self.step



def stop(d: ManagerDaemon) -> None:
    """The parts a test's unstarted daemon opened (no snapshot: the test's state is thrown away)."""
    d.loop.stop()
    d.actuator.stop()
    d.grpc.stop(0).wait(5)
    d._grpc_pool.shutdown(wait=False)
    d.store.close(snapshot=False)

def test_a_wall_clock_step_keeps_live_servers_and_jobs(tmp_path, monkeypatch):
    clock = SteppingWallClock()
    monkeypatch.setattr(managerd, "time", clock)
    d = ManagerDaemon(DaemonConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "st"), fsync=False,
                                   model=ManagerConfig(budget=None), heartbeat_s=1.0, heartbeat_misses=3,
                                   job_timeout_s=30.0))
    try:
        now = clock.time()
        d.store.submit({"type": "server_join", "server_id": "s1", "address": "127.0.0.1:1",
                        "capacity": 10**9, "now": now})
        d.store.submit({"type": "job_register", "job": "j", "dataset": "ab" * 8, "dataset_bytes": 10**6,
                        "n_items": 10, "n_gpus": 1, "now": now})
        d.liveness.beat("s1", now)
        d.liveness.touch_job("j", now)
        d.loop.run_once()
        assert d.store.model.registry.addresses() == ["127.0.0.1:1"] and "j" in d.store.model.jobs
        clock.step = 120.0  # the wall clock jumps 2 minutes; the server beat a moment ago
        d.liveness.beat("s1", clock.time())  # a heartbeat right after the step keeps it anyway...
        d.loop.run_once()
        assert d.store.model.registry.addresses() == ["127.0.0.1:1"]
        assert "j" in d.store.model.jobs, "a job that called 1 s ago was unregistered as silent for 30 s"
        clock.step = 240.0  # ...and without one, the next round must not drop it either
        d.loop.run_once()
        assert d.store.model.registry.addresses() == ["127.0.0.1:1"], "a live server left the ring"
        assert "j" in d.store.model.jobs
    finally:
        stop(d)


def test_a_silent_server_still_leaves_after_the_step():
    mono = [100.0]
    live = Liveness(1000.0, restart_grace=0.0, mono=lambda: mono[0])
    reg = Registry()
    reg.join("s1", "a:1", 10, 1000.0)
    live.beat("s1", 1000.0)
    mono[0] += 1.0
    assert live.dead_servers(reg, 1061.0, 3.0) == []  # wall +61 s, 1 s really passed
    mono[0] += 5.0
    assert live.dead_servers(reg, 1066.0, 3.0) == ["s1"]  # 6 s without a beat: dead
    mono[0] += 1.0
    assert live.dead_servers(reg, 1007.0 + 60.0 - 100.0, 3.0) == ["s1"]  # a step back revives nothing


def test_a_wall_clock_step_fires_no_timer_of_the_model(tmp_path, monkeypatch):
    """Before: every event's time was the raw wall clock, so a step forward past
    --dataset-grace ended an idle dataset's grace at once (forgotten, its data evicted) and
    a step back froze every timer of the model until the wall clock caught up."""
    clock = SteppingWallClock()
    monkeypatch.setattr(managerd, "time", clock)
    d = ManagerDaemon(DaemonConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "st"), fsync=False,
                                   model=ManagerConfig(budget=None, dataset_grace_s=300.0)))
    ds = "cd" * 8
    try:
        d.store.submit({"type": "job_register", "job": "j", "dataset": ds, "dataset_bytes": 10**6,
                        "n_items": 10, "n_gpus": 1, "now": d.clock()})
        d.store.submit({"type": "job_unregister", "job": "j", "reason": "done", "now": d.clock()})
        d.loop.run_once()
        assert d.store.model.datasets[ds].idle_since is not None
        clock.step = 3600.0  # an hour forward: the grace really has 300 s to go
        d.loop.run_once()
        assert ds in d.store.model.datasets, "an idle dataset was forgotten by a step of the wall clock"
        assert d.clock() - d.store.model.datasets[ds].idle_since < 60
    finally:
        stop(d)
