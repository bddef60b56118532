"""Worker-scaling policies journaled on the manager's state store (manager/workers.py,
manager/workerstate.py, the model's `workers` event): what is journaled and when,
replay, resumption after a restart, and what starts a policy again. The real
cachemanager killed with -9 is in tests/test_manager_workers.py."""
import pytest

from manager.model import ManagerConfig, Rejected
from manager.policy.autoscale import AutoscaleConfig, Autoscaler
from manager.policy.placement import PlacementConfig
from manager.policy.scaling import Measurement
from manager.service import StoreJournal
from manager.state import StateStore
from manager.workers import WorkerScaling
from manager.workerstate import decisive, saved_form

CFG = ManagerConfig()


def open_store(path) -> StateStore:
    return StateStore(str(path), CFG, fsync=False).open()


def register(store: StateStore, *jobs: str) -> None:
    for job in jobs:
        store.submit({"type": "job_register", "job": job, "dataset": "ab" * 8, "dataset_bytes": 100,
                      "n_items": 10, "n_gpus": 1, "token_hash": ""})


def scaling(store: StateStore, **over) -> WorkerScaling:
    s = WorkerScaling(autoscale=AutoscaleConfig(**over), placement=PlacementConfig(**over))
    s.attach(StoreJournal(store))
    return s


def decide(store, s, job, policy, bt, remote=0, local=0):
    with store.lock:  # as ScaleWorkers calls it
        return s.decide(job, policy, None if bt is None else Measurement(bt), remote, local)


def test_only_windows_that_change_the_policy_are_journaled(tmp_path):
    store = open_store(tmp_path)
    register(store, "j")
    s = scaling(store)                                   # settle 1, recheck every 10
    before = store.events_written
    decide(store, s, "j", "autoscale", None)             # a fresh start over nothing journaled: not
    got = [decide(store, s, "j", "autoscale", bt) for bt in (0.4, 0.4, 0.2, 0.2, 0.199, 0.2, 0.2)]
    assert [c.remote for c in got] == [2, 2, 4, 4, 3, 3, 3] and got[-1].phase == "converged"
    assert got[-3].phase == "settling"                   # 2 + the headroom, measured before converging
    assert store.events_written - before == 4           # three changes and converging, no settle window
    before = store.events_written
    for _ in range(10):                                  # the first re-check after the settle clears fresh_bar
        assert decide(store, s, "j", "autoscale", 0.2).remote == 3
    assert store.events_written == before + 1
    before = store.events_written
    for _ in range(35):                                  # converged: windows and re-checks change nothing
        assert decide(store, s, "j", "autoscale", 0.2).remote == 3
    assert store.events_written == before
    journaled = store.model.workers["j"]
    assert journaled["kind"] == "autoscale" and journaled["state"]["phase"] == "converged"
    assert journaled["state"]["conv"]["batch_time"] == 0.2      # the plateau it converged on
    store.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_reopened_store_resumes_the_policy_where_it_was(tmp_path, snapshot):
    store = open_store(tmp_path)
    register(store, "a", "p")
    s = scaling(store, settle=0)
    decide(store, s, "a", "autoscale", None)
    for bt in (0.4, 0.2):                                # ramping: 1 -> 2 -> 4, hi = 2 measured
        decide(store, s, "a", "autoscale", bt)
    decide(store, s, "p", "placement", None)
    for bt in (0.2, 0.1, 0.1, 0.1):                      # remote plateau at 2 (no headroom in placement), then a local worker
        c = decide(store, s, "p", "placement", bt)
    assert (c.remote, c.local, c.phase) == (2, 1, "add_local")
    live = {job: decisive(saved_form(s.jobs[job])) for job in ("a", "p")}
    digest = store.model.digest()
    store.close(snapshot=snapshot)                       # False: as after kill -9, replay the journal
    again = open_store(tmp_path)
    assert again.model.digest() == digest
    assert {job: decisive(again.model.workers[job]) for job in ("a", "p")} == live
    s2 = scaling(again, settle=0)
    c = decide(again, s2, "a", "autoscale", 0.2, remote=4)   # 4 did not help: settle on 2 + 1
    assert (c.remote, c.phase) == (3, "settling")            # from scratch it would try 5
    c = decide(again, s2, "p", "placement", 0.1, remote=2, local=1)
    assert (c.remote, c.local, c.phase) == (1, 1, "trim")     # the local worker kept batch time
    again.close()


def test_a_kind_or_configuration_change_starts_again_from_the_jobs_counts(tmp_path):
    store = open_store(tmp_path)
    register(store, "j")
    s = scaling(store, settle=0)
    decide(store, s, "j", "autoscale", None)
    for bt in (0.4, 0.2, 0.2, 0.2):
        decide(store, s, "j", "autoscale", bt)
    assert store.model.workers["j"]["state"]["phase"] == "converged"
    c = decide(store, scaling(store, settle=0, threshold=0.1), "j", "autoscale", 0.2, remote=2)
    assert (c.remote, c.phase) == (3, "ramping")          # another --policy-config: on from 2
    c = decide(store, scaling(store, settle=0), "j", "placement", 0.2, remote=3, local=0)
    assert (c.remote, c.local, c.phase) == (4, 0, "remote")
    assert store.model.workers["j"]["kind"] == "placement"
    store.close()


def test_a_job_dropped_takes_its_policy_out_of_the_state(tmp_path):
    store = open_store(tmp_path)
    register(store, "a", "b")
    s = scaling(store)
    for job in ("a", "b"):
        decide(store, s, job, "autoscale", None)
        assert decide(store, s, job, "autoscale", 0.4).remote == 2   # journaled; the next window settles
    store.submit({"type": "job_unregister", "job": "a", "reason": "expired"})
    assert set(store.model.workers) == {"b"} and "a" not in store.model.to_dict()["workers"]
    with store.lock:
        s.forget_except(store.model.jobs)
    assert set(s.jobs) == {"b"}
    register(store, "b")                                  # a retry: b keeps its policy
    store.submit({"type": "job_unregister", "job": "b", "reason": "expired"})
    register(store, "b")                                  # b back before its next window
    with store.lock:
        s.forget_except(store.model.jobs)
    assert "b" in s.jobs and "b" not in store.model.workers
    seq = store.seq
    assert decide(store, s, "b", "autoscale", 0.4).reason == ""  # a settle window, yet journaled again:
    assert store.seq == seq + 1                                  # the journal no longer held it
    assert store.model.workers["b"] == saved_form(s.jobs["b"])
    store.close(snapshot=False)
    assert set(open_store(tmp_path).model.workers) == {"b"}


def test_bad_workers_events_are_refused_and_not_journaled(tmp_path):
    store = open_store(tmp_path)
    register(store, "j")
    seq = store.seq
    good = saved_form(Autoscaler.start())
    with pytest.raises(Rejected, match="unknown job"):
        store.submit({"type": "workers", "job": "nobody", **good})
    with pytest.raises(Rejected, match="kind must be one of"):
        store.submit({"type": "workers", "job": "j", "kind": "hpa", "state": good["state"]})
    with pytest.raises(Rejected, match="bad autoscale policy state"):
        store.submit({"type": "workers", "job": "j", "kind": "autoscale", "state": {"workers": 3}})
    assert store.seq == seq and store.model.workers == {}
    store.close()


def test_a_journal_write_that_fails_leaves_the_journaled_policy(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    register(store, "j")
    s = scaling(store, settle=0)
    decide(store, s, "j", "autoscale", None)
    decide(store, s, "j", "autoscale", 0.4)              # 1 -> 2
    journaled = store.model.workers["j"]

    def full(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(store, "_append", full)
    with pytest.raises(OSError):
        decide(store, s, "j", "autoscale", 0.2)           # would go on to 4
    monkeypatch.undo()
    assert store.model.workers["j"] == journaled and "j" not in s.jobs
    c = decide(store, s, "j", "autoscale", 0.2, remote=2)  # resumes the journaled policy: the same step
    assert (c.remote, c.phase) == (4, "ramping")           # (from the job's 2 it would try 3)
    store.close()


def test_a_first_start_writes_nothing_a_restart_would_not_rebuild(tmp_path):
    """A fresh start with nothing journaled is what a restarted manager builds from the
    counts the job was given, so it costs no fsync: the first ScaleWorkers, which a job
    makes under the client's 1 s deadline and reads a timeout of as "no manager", does
    no disk write. A fresh start over a journaled policy is journaled (else a restart
    would resume the old one), and so is the first measurement's change."""
    store = open_store(tmp_path)
    register(store, "a", "p")
    s = scaling(store, settle=0)
    seq = store.seq
    first = {job: decide(store, s, job, kind, None) for job, kind in (("a", "autoscale"), ("p", "placement"))}
    assert store.seq == seq and store.model.workers == {}
    fresh = {job: decisive(saved_form(s.jobs[job])) for job in ("a", "p")}
    store.close(snapshot=False)                          # as after kill -9
    store = open_store(tmp_path)
    s2 = scaling(store, settle=0)
    rebuilt = {job: s2._start(kind, (first[job].remote, first[job].local))
               for job, kind in (("a", "autoscale"), ("p", "placement"))}
    assert {job: decisive(saved_form(p)) for job, p in rebuilt.items()} == fresh
    assert decide(store, s2, "a", "autoscale", 0.4, first["a"].remote).remote == 2   # the ramp's first step
    assert store.model.workers["a"]["state"]["workers"] == 2 and store.seq == seq + 1
    for bt in (0.2, 0.2):                                # 2 -> 4 -> converged: a policy to restart over
        decide(store, s2, "a", "autoscale", bt)
    seq = store.seq
    assert decide(store, s2, "a", "autoscale", None).remote == 1   # the job starts again
    assert store.seq == seq + 1 and store.model.workers["a"] == saved_form(s2.jobs["a"])
    store.close()


def test_a_journaled_policy_this_version_cannot_read_starts_again_from_the_counts(tmp_path, caplog):
    """A snapshot's policy written by another version (here: a field unknown to this one)
    must not make every window of the job fail: the policy starts again from the job's
    counts, with a warning, and the new one replaces it in the journal."""
    store = open_store(tmp_path)
    register(store, "j")
    bad = saved_form(Autoscaler.start(AutoscaleConfig(settle=0)))
    bad["state"]["config"]["retired_knob"] = 1
    store.model.workers["j"] = bad                       # as ManagerModel.from_dict loads a snapshot
    s = scaling(store, settle=0)
    c = decide(store, s, "j", "autoscale", 0.2, remote=3)
    assert (c.remote, c.phase) == (4, "ramping")          # on from the job's 3
    assert "cannot be read" in caplog.text
    assert store.model.workers["j"] == saved_form(s.jobs["j"])
    store.close()


def test_after_a_restart_a_window_at_counts_the_job_was_never_told_is_dropped(tmp_path):
    """The change is journaled before the answer: a manager killed in between comes back
    with a policy ahead of the job. The job's next window (at its old counts) is not
    the policy's; it is dropped and the journaled counts answered."""
    store = open_store(tmp_path)
    register(store, "j")
    s = scaling(store, settle=0)
    decide(store, s, "j", "autoscale", None)
    assert decide(store, s, "j", "autoscale", 0.4, remote=1).remote == 2   # journaled, never answered
    store.close(snapshot=False)
    again = open_store(tmp_path)
    s2 = scaling(again, settle=0)
    c = decide(again, s2, "j", "autoscale", 0.4, remote=1)
    assert (c.remote, c.reason, c.phase) == (2, "", "ramping")              # not "2 did not help"
    assert decide(again, s2, "j", "autoscale", 0.2, remote=2).remote == 4
    again.close()
