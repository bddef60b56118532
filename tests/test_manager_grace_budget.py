"""An idle dataset in its grace period never keeps the allocation above the budget:
when the budget shrinks (a server leaves), it gives up its space before the running
datasets lose theirs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from manager.effects import EvictDataset
from manager.model import ManagerConfig, ManagerModel, Rejected
from manager.policy import AllocConfig, Option, Phase

from test_manager_state import CFG, random_events

IDLE, RUNNING, OTHER = "aaaa0001", "bbbb0002", "cccc0003"


def total(m: ManagerModel) -> int:
    return sum(a.bytes for a in m.allocs.values())


def register(m, job: str, ds: str, now: float, size: int = 800_000) -> list:
    """On a ManagerModel (apply) or a StateStore (submit: journaled)."""
    apply = m.submit if hasattr(m, "submit") else m.apply
    return apply({"type": "job_register", "job": job, "dataset": ds, "dataset_bytes": size, "n_items": 100,
                    "n_gpus": 1, "now": now})


def two_full_datasets(mechanism: str) -> ManagerModel:
    """Two servers (budget 2 MB, from their capacity), two datasets held FULL by their
    measured jobs (b = 4, synthetic), then the job of IDLE leaves: IDLE is in its grace period."""
    m = ManagerModel(ManagerConfig(budget=None, dataset_grace_s=300.0,
                                   alloc=AllocConfig(mechanism=mechanism, chunk_bytes=100_000)))
    for sid in "ab":
        m.apply({"type": "server_join", "server_id": sid, "address": f"h:{sid}", "capacity": 1_000_000,
                 "now": 1000.0})
    register(m, "j1", IDLE, 1000.0)
    register(m, "j2", RUNNING, 1000.0)
    for j in ("j1", "j2"):
        p = m.board.jobs[j]
        p.benefit = p.known_benefit = 4.0
        p.phase, p.next_probe_at = Phase.DECIDED, 1e9
    m.apply({"type": "tick", "now": 1000.5})
    assert {d: a.option for d, a in m.allocs.items()} == {IDLE: Option.FULL, RUNNING: Option.FULL}
    m.apply({"type": "job_unregister", "job": "j1", "reason": "done", "now": 1001.0})
    assert m.allocs[IDLE].option is Option.FULL and m.allocs[IDLE].reason.startswith("idle: kept")
    return m


@pytest.mark.parametrize("mechanism", ["shares", "chunks"])
def test_an_idle_dataset_gives_up_its_space_before_running_jobs_lose_theirs(mechanism):
    m = two_full_datasets(mechanism)
    # a server leaves: the budget (1 MB) holds one of the two datasets whole, not both
    m.apply({"type": "server_leave", "server_id": "b", "reason": "gone", "now": 1002.0})
    m.apply({"type": "tick", "now": 1003.0})
    assert m.budget() == 1_000_000 and total(m) <= m.budget()
    assert m.allocs[IDLE].bytes == 0 and m.allocs[IDLE].option is Option.NONE
    assert m.allocs[RUNNING].option is Option.FULL  # the running job's dataset lost nothing
    assert any(d["dataset"] == IDLE and "gave up its space" in d["reason"] for d in m.decisions)
    assert IDLE in m.datasets  # still known (its grace period runs on), only its space went


def test_a_budget_below_the_idle_dataset_alone_still_holds():
    m = two_full_datasets("shares")
    m.apply({"type": "server_leave", "server_id": "b", "reason": "gone", "now": 1002.0})
    m.apply({"type": "server_join", "server_id": "a", "address": "h:a", "capacity": 500_000, "now": 1003.0})
    m.apply({"type": "tick", "now": 1004.0})
    assert m.budget() == 500_000 and total(m) <= m.budget()
    assert m.allocs[IDLE].bytes == 0 and m.allocs[RUNNING].bytes > 0  # a share of what is left


@pytest.mark.parametrize("mechanism", ["shares", "chunks"])
def test_the_budget_follows_a_server_leaving_at_once(mechanism):
    """Not at the next tick: the leave itself re-runs allocation (budget from capacity)."""
    m = two_full_datasets(mechanism)
    effects = m.apply({"type": "server_leave", "server_id": "b", "reason": "gone", "now": 1002.0})
    assert m.budget() == 1_000_000 and total(m) <= m.budget()
    assert any(isinstance(e, EvictDataset) and e.dataset == IDLE for e in effects)
    assert m.allocs[RUNNING].option is Option.FULL  # 800 kB still fit: the running dataset lost nothing


@pytest.mark.parametrize("mechanism", ["shares", "chunks"])
def test_an_idle_dataset_keeps_its_space_while_the_budget_holds_it(mechanism):
    """The grace period still protects an idle dataset from new demand: a new job's
    dataset gets what is left, not the idle dataset's space."""
    m = two_full_datasets(mechanism)
    m.apply({"type": "job_unregister", "job": "j2", "reason": "done", "now": 1001.5})
    register(m, "j3", OTHER, 1002.0, size=1_500_000)
    m.apply({"type": "tick", "now": 1003.0})
    assert m.allocs[IDLE].option is Option.FULL and m.allocs[RUNNING].option is Option.FULL
    assert m.allocs[OTHER].bytes <= m.budget() - 1_600_000 and total(m) <= m.budget()


def test_of_two_idle_datasets_the_longer_idle_gives_up_first():
    m = two_full_datasets("chunks")
    m.apply({"type": "job_unregister", "job": "j2", "reason": "done", "now": 1001.5})  # RUNNING idle too, later
    m.apply({"type": "server_leave", "server_id": "b", "reason": "gone", "now": 1002.0})
    assert m.allocs[IDLE].bytes == 0  # idle since 1001.0
    assert m.allocs[RUNNING].option is Option.FULL and m.allocs[RUNNING].reason.startswith("idle: kept")
    assert total(m) <= m.budget()


@pytest.mark.parametrize("mechanism", ["shares", "chunks"])
@pytest.mark.parametrize("seed", range(12))
def test_allocations_never_exceed_the_budget(mechanism, seed):
    """Random workloads with the budget from the servers' capacity (servers come and go)."""
    m = ManagerModel(replace(CFG, budget=None, alloc=replace(CFG.alloc, mechanism=mechanism)))
    for ev in random_events(seed, 400, m):
        try:
            m.apply(ev)
        except Rejected:
            continue
        assert total(m) <= m.budget(), (ev, {d: a.bytes for d, a in m.allocs.items()})


def test_giving_up_replays_to_the_same_state(tmp_path):
    """Events only (the prior benefits, chunks: both datasets FULL), through the journal:
    the give-up at the server's leave is rebuilt exactly after a crash."""
    import os

    from manager.state import StateStore

    cfg = ManagerConfig(budget=None, dataset_grace_s=300.0, alloc=AllocConfig(mechanism="chunks", chunk_bytes=100_000))
    store = StateStore(str(tmp_path), cfg, fsync=False).open()
    for sid in "ab":
        store.submit({"type": "server_join", "server_id": sid, "address": f"h:{sid}", "capacity": 1_000_000,
                      "now": 1000.0})
    register(store, "j1", IDLE, 1000.0)
    register(store, "j2", RUNNING, 1000.0)
    assert store.model.allocs[IDLE].option is Option.FULL and store.model.allocs[RUNNING].option is Option.FULL
    store.submit({"type": "job_unregister", "job": "j1", "reason": "done", "now": 1001.0})
    store.submit({"type": "server_leave", "server_id": "b", "reason": "gone", "now": 1002.0})
    m = store.model
    assert total(m) <= m.budget() and m.allocs[IDLE].bytes == 0 and m.allocs[RUNNING].option is Option.FULL
    assert any("gave up its space" in d["reason"] for d in m.decisions)
    live = m.to_dict()
    os.close(store._lock_fd)  # kill -9
    os.close(store._journal_fd)
    again = StateStore(str(tmp_path), cfg, fsync=False).open()
    assert again.model.to_dict() == live
    again.close()
