"""Autocache in the manager's state machine (manager/model.py, manager/pipelines.py):
decisions per (dataset, pipeline), shared by later jobs, journaled (replay gives the
same state), and transformed sets allocated against the budget with their benefit."""
import pytest

from cacheserver.vocab import transformed_tag
from manager.model import ManagerConfig, ManagerModel, Rejected
from manager.policy.autocache import costs_to_dict
from test_policy_autocache import costs

DS = "ab" * 32
FP = "cd" * 32
FP2 = "ef" * 32
MB = 1 << 20


def model(budget=4000 * MB):
    m = ManagerModel(ManagerConfig(budget=budget))
    events = []

    def ev(e):
        events.append(e)
        return m.apply(e)
    return m, events, ev


def register(ev, job, t, ds=DS, n=2000, size=2000 * 128 * 1024):
    ev({"type": "job_register", "job": job, "dataset": ds, "dataset_bytes": size, "n_items": n,
        "n_gpus": 1, "now": t})


def pipeline(ev, job, c, t, fp=FP, ds=DS):
    d = costs_to_dict(c)
    d.pop("room_bytes")
    return ev({"type": "pipeline", "job": job, "dataset": ds, "fingerprint": fp, "costs": d, "now": t})


def test_first_report_decides_and_a_second_job_gets_the_same_decision():
    m, events, ev = model()
    register(ev, "j1", 1.0)
    register(ev, "j2", 2.0)
    pipeline(ev, "j1", costs(prefix_s=0.008), 3.0)
    rec = m.pipelines[f"{DS}/{FP}"]
    assert rec.mode == "transformed" and rec.decided_at == 3.0
    # j2 measured a cheap prefix: alone it would not cache transformed, but the pipeline is decided
    pipeline(ev, "j2", costs(prefix_s=0.0), 4.0)
    assert rec.mode == "transformed" and sorted(rec.measured) == ["j1", "j2"]
    assert m.counters["autocache_decisions"] == 1
    # another pipeline over the same dataset is decided on its own
    pipeline(ev, "j2", costs(prefix_s=0.0, marker_bytes=8 * 128 * 1024, cache_read_marker_s=0.003), 5.0, fp=FP2)
    assert m.pipelines[f"{DS}/{FP2}"].mode == "source"
    # replay: the same events give the same state
    m2 = ManagerModel(ManagerConfig(budget=4000 * MB))
    for e in events:
        m2.apply(e)
    assert m2.digest() == m.digest()
    assert ManagerModel.from_dict(m.to_dict()).digest() == m.digest()


def test_a_later_job_measuring_very_differently_re_decides():
    m, events, ev = model()
    register(ev, "j1", 1.0)
    register(ev, "j2", 2.0)
    kib = 1024
    pipeline(ev, "j1", costs(prefix_s=0.0025, marker_bytes=8 * 128 * kib, cache_read_marker_s=0.0011), 3.0)
    rec = m.pipelines[f"{DS}/{FP}"]
    assert rec.mode == "transformed" and rec.tag in m.datasets
    # j2 reads the 8x outputs back at 4 ms each: on both jobs' measurements transformed projects
    # 4x dearer than source, far past the margin: the pipeline is decided again
    pipeline(ev, "j2", costs(prefix_s=0.0, marker_bytes=8 * 128 * kib, cache_read_marker_s=0.004), 4.0)
    assert rec.mode == "source" and rec.decided_at == 4.0
    assert rec.decision["reason"].startswith("re-decided, was transformed")
    assert m.counters["autocache_decisions"] == 2
    assert rec.tag not in m.job_gains()  # the transformed set lost its jobs: it goes idle, then away
    # journaled: replay gives the same state
    m2 = ManagerModel(ManagerConfig(budget=4000 * MB))
    for e in events:
        m2.apply(e)
    assert m2.digest() == m.digest() and m2.pipelines[f"{DS}/{FP}"].decision == rec.decision
    # a third report close to the combined measurements changes nothing
    register(ev, "j3", 5.0)
    pipeline(ev, "j3", costs(prefix_s=0.0, marker_bytes=8 * 128 * kib, cache_read_marker_s=0.003), 6.0)
    assert rec.mode == "source" and rec.decided_at == 4.0 and m.counters["autocache_decisions"] == 2


def test_transformed_set_is_allocated_with_its_bytes_and_benefit():
    m, _, ev = model()
    register(ev, "j1", 1.0)
    pipeline(ev, "j1", costs(prefix_s=0.008), 2.0)
    tag = transformed_tag(DS, FP)
    assert tag in m.datasets and m.datasets[tag].bytes == int(2000 * 128 * 1024 * 2.5)
    a = m.allocs[tag]
    # j1's gain moved to the transformed set with b = compute / transformed = 8 s / 1.4 s; a
    # shares allocation pins it up to where the job stops gaining (1 - 1/b), the rest is LRU
    b = 8.0 / 1.4
    assert "b=5.71" in a.reason and a.spare
    assert a.bytes == pytest.approx((1 - 1 / b) * m.datasets[tag].bytes, rel=0.01)
    assert m.allocs[DS].bytes == 0 and m.allocs[DS].reason == "no jobs use it"  # source items not needed
    assert m.plan(tag)["share_items"] == pytest.approx(2000 * (1 - 1 / b), abs=2)


def test_room_too_small_for_the_transformed_set_is_in_the_decision():
    # 150 MB budget: 23% of the 625 MiB transformed set fits; the decision saw the room and
    # cached source (57% of it fits, and its misses cost no prefix CPU)
    m, _, ev = model(budget=150 * MB)
    register(ev, "j1", 1.0)
    pipeline(ev, "j1", costs(prefix_s=0.002), 2.0)
    rec = m.pipelines[f"{DS}/{FP}"]
    assert rec.room_bytes == 150 * MB
    assert rec.mode == "source", rec.decision["reason"]
    assert "room 157.3 MB holds 24% transformed, 60% source" in rec.decision["reason"]
    # with the whole budget it would have cached transformed
    m, _, ev = model()
    register(ev, "j1", 1.0)
    pipeline(ev, "j1", costs(prefix_s=0.002), 2.0)
    assert m.pipelines[f"{DS}/{FP}"].mode == "transformed"


def test_refusals_are_not_applied():
    m, _, ev = model()
    register(ev, "j1", 1.0)
    with pytest.raises(Rejected) as e:
        pipeline(ev, "nobody", costs(), 2.0)
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(Rejected) as e:
        pipeline(ev, "j1", costs(), 2.0, ds="99" * 32)
    assert e.value.code == "INVALID_ARGUMENT"
    bad = costs_to_dict(costs())
    bad.pop("room_bytes")
    bad["store_read_s"] = -1.0
    with pytest.raises(Rejected, match="store_read_s"):
        ev({"type": "pipeline", "job": "j1", "dataset": DS, "fingerprint": FP, "costs": bad, "now": 2.0})
    assert not m.pipelines


def test_costs_refused_with_the_other_jobs_leave_the_state_as_it_was():
    """Each report may be valid alone and overflow merged: the refusal changes nothing
    (no journal entry is written for it, so replay would not have it either)."""
    m, _, ev = model()
    register(ev, "j1", 1.0)
    register(ev, "j2", 1.5)
    pipeline(ev, "j1", costs(source_bytes=1e307), 2.0)
    before = m.digest()
    with pytest.raises(Rejected, match="source_bytes must be a finite number"):
        pipeline(ev, "j2", costs(source_bytes=1.7e308), 3.0)
    assert m.digest() == before and sorted(m.pipelines[f"{DS}/{FP}"].measured) == ["j1"]
    pipeline(ev, "j1", costs(source_bytes=1e307), 4.0)  # the job's next report is taken as before


def test_transformed_set_forgotten_after_its_jobs_left():
    m, _, ev = model()
    register(ev, "j1", 1.0)
    pipeline(ev, "j1", costs(prefix_s=0.008), 2.0)
    tag = transformed_tag(DS, FP)
    ev({"type": "job_unregister", "job": "j1", "now": 10.0})
    assert m.datasets[tag].idle_since == 10.0 and m.allocs[tag].bytes > 0  # kept for the grace period
    effects = ev({"type": "tick", "now": 10.0 + 301})
    effects += ev({"type": "tick", "now": 10.0 + 302})
    assert tag not in m.datasets and not m.pipelines
    assert any(getattr(e, "dataset", None) == tag and type(e).__name__ == "EvictDataset" for e in effects)
