"""A dataset's plan version never goes back, also when the dataset is forgotten (no job
for a whole grace period) and registered again: clients keep the newer of two plans they
hold (ManagerClient._remember), so a version that restarted would be ignored until the
client registers again."""
from __future__ import annotations

import os

import pytest

from manager.model import ManagerConfig, ManagerModel
from manager.policy import AllocConfig
from manager.state import StateStore

DS = "d" * 16
GRACE = 10.0


def config(mechanism: str) -> ManagerConfig:
    return ManagerConfig(budget=1_000_000, dataset_grace_s=GRACE,
                         alloc=AllocConfig(mechanism=mechanism, chunk_bytes=100_000))


def register(job: str, now: float) -> dict:
    return {"type": "job_register", "job": job, "dataset": DS, "dataset_bytes": 2_000_000, "n_items": 100,
            "n_gpus": 1, "now": now}


def busy_life(apply, plan, t: float) -> tuple[float, int]:
    """A job's life on DS: chunks load and are released (each a new plan version), then it
    leaves and DS is forgotten after its grace period. Returns (time, highest version seen)."""
    apply(register("j", t))
    seen = plan()["version"]
    for _ in range(5):
        t += 1.0
        p = plan()
        if p["loading"] >= 0:
            apply({"type": "loaded", "dataset": DS, "chunk": p["loading"], "fraction": 1.0, "now": t})
        if plan()["chunks"]:
            apply({"type": "release", "job": "j", "dataset": DS, "chunk": plan()["chunks"][0], "now": t})
        seen = max(seen, plan()["version"])
    apply({"type": "job_unregister", "job": "j", "reason": "done", "now": t + 1.0})
    seen = max(seen, plan()["version"])
    return t + 1.0, seen


@pytest.mark.parametrize("mechanism", ["chunks", "shares"])
def test_a_forgotten_dataset_registered_again_continues_its_versions(mechanism):
    m = ManagerModel(config(mechanism))
    t, seen = busy_life(m.apply, lambda: m.plan(DS, "j" if "j" in m.jobs else ""), 0.0)
    m.apply({"type": "tick", "now": t + GRACE + 1.0})
    assert DS not in m.datasets  # forgotten
    m.apply(register("j2", t + GRACE + 2.0))
    assert m.plan(DS, "j2")["version"] > seen
    assert m.plan(DS)["version"] > seen  # the dataset-wide plan too


def test_the_high_water_mark_survives_a_crash_and_a_snapshot(tmp_path):
    store = StateStore(str(tmp_path), config("chunks"), fsync=False).open()
    t, seen = busy_life(store.submit, lambda: store.model.plan(DS, "j" if "j" in store.model.jobs else ""), 1000.0)
    store.submit({"type": "tick", "now": t + GRACE + 1.0})
    assert DS not in store.model.datasets and store.model.plan_floor > seen
    live = store.model.to_dict()
    os.close(store._lock_fd)  # kill -9: no final snapshot, the journal replays
    os.close(store._journal_fd)
    again = StateStore(str(tmp_path), config("chunks"), fsync=False).open()  # replays, then snapshots
    assert again.model.to_dict() == live and again.model.plan_floor > seen
    again.close()
    third = StateStore(str(tmp_path), config("chunks"), fsync=False).open()  # from the snapshot alone
    assert third.model.to_dict() == live
    third.submit(register("j2", t + GRACE + 2.0))
    assert third.model.plan(DS, "j2")["version"] > seen
    third.close()


def test_a_state_without_forgotten_datasets_reads_and_digests_as_before():
    m = ManagerModel(config("chunks"))
    m.apply(register("j", 0.0))
    assert m.plan_floor == 0 and "plan_floor" not in m.to_dict()
    assert ManagerModel.from_dict(m.to_dict()).digest() == m.digest()
