"""The daemon's decision loop forgets a server out of the ring by time measured like silences
(Liveness.forgettable, manager/decisions.py): before, it compared wall times, so a step of
the wall clock forward past --forget-servers-after forgot every server out of the ring at
once, and a step back (the state's time does not go back, so a leave is journaled ahead of
the clock) put forgetting off by the step."""
from __future__ import annotations

import time

import pytest

import manager.managerd as managerd
from manager.managerd import DaemonConfig, ManagerDaemon
from manager.model import ManagerConfig
from procs import wait_until
from test_review_liveness_clock_step import SteppingWallClock, stop


def _join_two(d: ManagerDaemon, clock: SteppingWallClock) -> None:
    for sid, port in (("s1", 1), ("s2", 2)):
        d.store.submit({"type": "server_join", "server_id": sid, "address": f"127.0.0.1:{port}",
                        "capacity": 10**9, "now": clock.time()})
        d.liveness.beat(sid, clock.time())


def _round(d: ManagerDaemon, clock: SteppingWallClock) -> list[str]:
    d.liveness.beat("s2", clock.time())  # s2 stays in the ring
    d.loop.run_once()
    return sorted(d.store.model.registry.servers)


@pytest.mark.parametrize("before_leave, after_leave", [(0.0, 7200.0), (-7200.0, 0.0)], ids=["forward", "back"])
def test_a_wall_clock_step_neither_forgets_at_once_nor_puts_forgetting_off(tmp_path, monkeypatch, before_leave,
                                                                           after_leave):
    clock = SteppingWallClock()
    monkeypatch.setattr(managerd, "time", clock)
    d = ManagerDaemon(DaemonConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "st"), fsync=False,
                                   model=ManagerConfig(budget=None), heartbeat_s=60.0, forget_servers_after_s=1.0))
    try:
        _join_two(d, clock)
        clock.step = before_leave  # back: the state's time stays ahead, and so does the leave's
        d.store.submit({"type": "server_leave", "server_id": "s1", "now": clock.time(), "reason": "test"})
        assert _round(d, clock) == ["s1", "s2"]
        clock.step = before_leave + after_leave
        assert _round(d, clock) == ["s1", "s2"], "a step of the wall clock forgot a server out of the ring"
        left = time.monotonic()
        wait_until(lambda: _round(d, clock) == ["s2"], "the server forgotten 1 s after it left", 5)
        assert time.monotonic() - left < 2.5
    finally:
        stop(d)
