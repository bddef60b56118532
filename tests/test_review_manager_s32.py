"""Review of the manager's plan versions across a restore (s32), with real cachemanager processes.

A state dir restored from an older backup (a snapshot without the journal written after it) counted
plan versions on from the snapshot's: the versions handed out after the backup came again, naming
other plans. A job holding one of them took the new plan for the one it had, or (holding a higher
one) ignored it as older. A plan version that changes now takes at least the event's time in ms,
so the first new plan after any restart is above every version handed out before it."""
from __future__ import annotations

import os
import shutil

from manager.manager_client import ManagerClient, Plan
from manager.model import ManagerConfig, ManagerModel
from manager.policy import AllocConfig
from procs import cachemanager, free_port
from test_review_manager_s31 import _walk

DS = "5e" * 32
CHUNKED = ("--chunks", "--budget", "30MB", "--chunk-size", "10MB")


def _turns(mc: ManagerClient, job: str, plan: Plan, turns: int) -> list[Plan]:
    """Go on loading and releasing chunks from ``plan`` as the job's client would (see _walk)."""
    plans = [plan]
    for _ in range(turns):
        if plans[-1].loading is not None:
            mc.report_loaded(DS, plans[-1].loading, 1.0)
            plans.append(mc.get_plan(DS, job))
        if plans[-1].chunks:
            plans.append(mc.release_chunk(job, DS, plans[-1].chunks[0]))
    return plans


def test_a_state_restored_from_an_older_snapshot_never_repeats_a_plan_version(tmp_path):
    state, backup, port = str(tmp_path / "m"), str(tmp_path / "snapshot.backup"), free_port()
    m = cachemanager(state, port, *CHUNKED).start()
    try:
        with ManagerClient(f"127.0.0.1:{port}", timeout=5) as mc:  # the job's client throughout
            before = _walk(mc, "job", 2)
            m.kill()
            m = cachemanager(state, port, *CHUNKED).start()  # it starts from a fresh snapshot: the backup
            shutil.copyfile(os.path.join(state, "snapshot.json"), backup)
            before += _turns(mc, "job", mc.get_plan(DS, "job"), 4)
            highest = max(p.version for p in before)
            assert before[-1].option == "chunked" and highest > before[0].version
            m.kill()
            os.remove(os.path.join(state, "journal.jsonl"))  # the backup is restored without it
            shutil.copyfile(backup, os.path.join(state, "snapshot.json"))
            # A bigger budget: the restored manager re-plans the dataset FULL, a new plan.
            m = cachemanager(state, port, "--chunks", "--budget", "200MB", "--chunk-size", "10MB").start()
            plan = mc.get_plan(DS, "job")
            assert plan.version > highest, \
                f"the new plan's version {plan.version} repeats one handed out before ({highest} at most)"
            assert plan.option == "full"  # the job's client took it: not older than the plans it held
    finally:
        m.kill()


def test_a_changed_plan_version_is_at_least_the_events_time_in_ms():
    """Unit view of the rule: an event that changes a version lifts it to its `now` in ms; one that
    changes none leaves versions alone (replay and quiet restarts give the same state)."""
    m = ManagerModel(ManagerConfig(budget=30_000_000, alloc=AllocConfig(mechanism="chunks", chunk_bytes=10_000_000)))
    m.apply({"type": "job_register", "job": "j", "dataset": DS, "dataset_bytes": 100_000_000,
             "n_items": 1000, "n_gpus": 1, "now": 1000.0, "token_hash": ""})
    v0 = m.plan_version(DS)
    assert m.plan(DS)["option"] == "chunked" and v0 >= 1_000_000
    m.apply({"type": "tick", "now": 5000.0})
    assert m.plan_version(DS) == v0
    m.apply({"type": "loaded", "dataset": DS, "chunk": 0, "fraction": 1.0, "now": 7000.5})
    assert m.plan_version(DS) == 7_000_500
