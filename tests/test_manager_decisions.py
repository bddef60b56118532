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
