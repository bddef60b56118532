"""Benefit-sized shares (manager/policy/shares.py) and benefit by regression
(manager/policy/regression.py), on synthetic and simulated traces."""
import itertools
import random

import pytest

from manager.model import ManagerConfig, ManagerModel
from manager.policy import AllocConfig, Batch, Option, ProbeConfig
from manager.policy.allocation import GB, DatasetDemand
from manager.policy.probing import JobGain, JobProbe, Phase
from manager.policy.regression import regress_benefit
from manager.policy.shares import (allocate_shares, in_share, job_speedup, share_items, share_value,
                                   spare_value)


def ds(name, size, *jobs):
    return DatasetDemand(name, size, tuple(JobGain(f"{name}-{i}", n, b) for i, (n, b) in enumerate(jobs)))


# ------------------------------------------------------------- value model

def test_speedup_saturates_at_one_minus_one_over_b():
    assert job_speedup(3.0, 0.0) == 1.0
    assert job_speedup(3.0, 0.5) == pytest.approx(2.0)
    assert job_speedup(3.0, 2 / 3) == pytest.approx(3.0)
    assert job_speedup(3.0, 0.9) == 3.0          # beyond saturation: nothing more
    assert job_speedup(1.0, 0.9) == 1.0          # compute-bound: never


def test_share_value_is_what_a_share_adds_over_the_shared_lru():
    single = ds("s", 100 * GB, (4, 3.0))
    assert spare_value(single) == 0.0            # a lone job shares nothing through the LRU
    assert share_value(single, 50 * GB) == pytest.approx(4 * 1.0)
    assert share_value(single, 100 * GB) == pytest.approx(4 * 2.0)
    multi = ds("m", 100 * GB, *[(4, 3.0)] * 4)
    assert spare_value(multi) == pytest.approx(0.9 * 16 * 2)
    assert share_value(multi, 100 * GB) == pytest.approx(16 * 2 - 0.9 * 16 * 2)
    assert share_value(ds("c", 100 * GB, (4, 1.02)), 100 * GB) == 0.0  # noise-level b: worthless


# ------------------------------------------------------------- allocation

def test_io_bound_dataset_gets_the_room_compute_bound_gets_none():
    a = allocate_shares([ds("compute", 200 * GB, (4, 1.0), (4, 1.01)), ds("io", 200 * GB, (4, 4.0), (4, 4.0))],
                        220 * GB)
    assert a["io"].bytes == 200 * GB and a["compute"].bytes == 0
    assert "no job benefits" in a["compute"].reason


def test_a_little_benefit_elsewhere_does_not_keep_a_large_one_from_being_pinned_whole():
    # compute gains 1.15x (a user of the shared LRU), io 4x; pinning io whole leaves
    # the LRU 20 GB, but saves far more than compute could get from it
    a = allocate_shares([ds("compute", 200 * GB, (4, 1.15), (4, 1.15)), ds("io", 200 * GB, (4, 4.0), (4, 4.0))],
                        220 * GB)
    assert a["io"].bytes == 200 * GB and a["compute"].bytes == 0
    # ... nor a lone job of it that could use a partial share (one compute job left)
    a = allocate_shares([ds("compute", 200 * GB, (4, 1.4)), ds("io", 200 * GB, (4, 4.0), (4, 4.0))], 220 * GB)
    assert a["io"].bytes == 200 * GB and a["compute"].bytes == 0
    # ... yet not on priors alone: an unmeasured dataset is not pinned past the reserve
    prior = DatasetDemand("io", 200 * GB, (JobGain("io-0", 4, None), JobGain("io-1", 4, None)))
    a = allocate_shares([ds("compute", 200 * GB, (4, 1.0), (4, 1.0)), prior], 220 * GB)
    assert a["io"].bytes == 0
    # ... and where the pin adds less than the other dataset loses of the LRU, both share it
    a = allocate_shares([ds("x", 200 * GB, (4, 1.3), (4, 1.3)), ds("y", 200 * GB, (4, 1.3), (4, 1.3))], 220 * GB)
    assert a["x"].bytes == 0 and a["y"].bytes == 0


def test_multi_job_datasets_are_pinned_whole_or_not_at_all():
    a = allocate_shares([ds("big", 1000 * GB, *[(4, 3.0)] * 4)], 300 * GB)
    assert a["big"].bytes == 0                   # a part would only take the shared LRU's room


def test_a_single_job_gets_its_saturation_share():
    a = allocate_shares([ds("one", 300 * GB, (8, 3.0))], 250 * GB, AllocConfig(spare_reserve=0.0))
    assert a["one"].bytes == pytest.approx(200 * GB, rel=0.01)   # (1 - 1/3) of 300 GB is all it needs


def test_pins_leave_the_shared_lru_its_reserve():
    dss = [ds("a", 90 * GB, *[(4, 1.5)] * 4), ds("b", 531 * GB, *[(4, 2.0)] * 4)]
    a = allocate_shares(dss, 100 * GB)           # pinning a (90 of 100 GB) would starve b's sharing
    assert a["a"].bytes == 0 and a["b"].bytes == 0
    a = allocate_shares(dss, 705 * GB)
    assert a["a"].bytes == 90 * GB


def test_shares_never_exceed_the_budget_and_are_deterministic():
    rng = random.Random(5)
    for _ in range(200):
        dss = [ds(f"d{i}", rng.randint(1, 500) * GB,
                  *[(rng.randint(1, 8), rng.choice([1.0, 1.3, 2.0, 4.0])) for _ in range(rng.randint(1, 4))])
               for i in range(rng.randint(1, 4))]
        budget = rng.randint(0, 800) * GB
        a = allocate_shares(dss, budget)
        assert sum(s.bytes for s in a.values()) <= budget
        assert a == allocate_shares(list(reversed(dss)), budget)
        for d in dss:
            assert 0 <= a[d.name].bytes <= d.size_bytes


def test_hysteresis_keeps_the_incumbent_share():
    x, y = ds("x", 100 * GB, (4, 10.0)), ds("y", 100 * GB, (4, 10.5))   # each saturates at ~90%
    cfg = AllocConfig(spare_reserve=0.0)
    fresh = allocate_shares([x, y], 100 * GB, cfg)
    assert fresh["y"].bytes > 80 * GB > fresh["x"].bytes
    kept = allocate_shares([x, y], 100 * GB, cfg, current={"x": fresh["y"].bytes})
    assert kept["x"].bytes > 80 * GB > kept["y"].bytes


def test_share_membership_is_a_fixed_sample_that_grows_by_adding():
    n = 1000
    small = {i for i in range(n) if in_share(i, n, 100)}
    big = {i for i in range(n) if in_share(i, n, 400)}
    assert len(small) == 100 and len(big) == 400 and small <= big
    assert max(small) - min(small) > n // 2      # spread over the digest order
    assert share_items(50, 100, 1000) == 500 and share_items(200, 100, 7) == 7 and share_items(0, 100, 7) == 0


# ------------------------------------------------------------- regression

def pipelined(t_hit, t_miss, m, rng):
    return max(t_hit, m * t_miss) * rng.uniform(0.95, 1.05)


@pytest.mark.parametrize("t_hit,t_miss", [(1.0, 4.0), (2.0, 2.0), (1.0, 1.5)])
def test_regression_recovers_benefit_conservatively(t_hit, t_miss):
    rng = random.Random(1)
    obs = []
    for _ in range(300):
        m = rng.random()
        obs.append((m, pipelined(t_hit, t_miss, m, rng)))
    est = regress_benefit(obs)
    assert est is not None
    true_b = t_miss / t_hit
    assert 1.0 <= est.benefit <= true_b * 1.1
    assert est.benefit >= 1.0 + 0.6 * (true_b - 1.0)   # the hinge costs some, not most


def test_regression_refuses_without_spread_or_samples():
    rng = random.Random(2)
    assert regress_benefit([(0.5, 1.0)] * 10) is None
    assert regress_benefit([(0.5 + rng.uniform(-0.01, 0.01), rng.uniform(1, 2)) for _ in range(100)]) is None


def test_passive_probe_decides_without_bypass():
    cfg = ProbeConfig(passive=True, passive_every=25)
    job = JobProbe("j", "d", 1)
    rng = random.Random(3)
    out, t = [], 0.0
    for _ in range(200):
        m = rng.random()
        d = pipelined(1.0, 4.0, m, rng)
        t += d
        out += job.report([Batch(t, d, 1.0 - m)], t, cfg)
    assert job.phase is Phase.DECIDED and job.benefit > 2.5
    assert all(tr.mode.value == "normal" for tr in out)   # never in bypass
    assert not job.due(t, cfg)


def test_passive_job_falls_back_to_a_probe_when_unsure():
    cfg = ProbeConfig(passive=True, passive_probe_after=50)
    job = JobProbe("j", "d", 1)
    for k in range(60):   # every batch a miss: no spread, nothing to regress
        job.report([Batch(k + 1.0, 1.0, 0.0)], k + 1.0, cfg)
    assert job.due(61.0, cfg)


def test_model_default_gives_the_io_bound_dataset_the_room():
    m = ManagerModel(ManagerConfig(budget=220, probe=ProbeConfig(passive=True)))
    for name, n in itertools.product(("compute", "io"), range(2)):
        m.apply({"type": "job_register", "job": f"{name}{n}", "dataset": name, "dataset_bytes": 200,
                 "n_items": 2000, "n_gpus": 4, "now": 0.0})
    rng = random.Random(4)
    t = 0.0
    for _ in range(100):
        for name, n in itertools.product(("compute", "io"), range(2)):
            mf = rng.random()
            d = pipelined(4.0, 4.0, mf, rng) if name == "compute" else pipelined(1.0, 4.0, mf, rng)
            t += 0.01
            m.apply({"type": "batches", "job": f"{name}{n}", "batches": [[t, d, 1 - mf]], "now": t})
    m.apply({"type": "tick", "now": t + 1})
    assert m.allocs["io"].option is Option.FULL and m.allocs["io"].share == 200
    assert m.allocs["compute"].option is Option.NONE and not m.allocs["compute"].spare
    assert m.plan("io", "io0")["share_items"] == 2000


def test_a_full_dataset_stays_full_when_a_job_leaving_makes_its_share_partial():
    m = ManagerModel(ManagerConfig(budget=300, probe=ProbeConfig(passive=True)))
    for j in ("a", "b"):
        m.apply({"type": "job_register", "job": j, "dataset": "d", "dataset_bytes": 200, "n_items": 100,
                 "n_gpus": 1, "now": 0.0})
    for j in ("c", "c2"):  # two jobs that gain: pinning "d" whole past the LRU's reserve costs them more
        m.apply({"type": "job_register", "job": j, "dataset": "other", "dataset_bytes": 900, "n_items": 100,
                 "n_gpus": 1, "now": 0.0})
    m.allocs["d"] = m.allocs["d"].__class__("d", Option.FULL, 200, 200, 1.0, "full", True, 200)
    for j in ("a", "c", "c2"):
        m.board.jobs[j].benefit = m.board.jobs[j].known_benefit = 2.0
    effects = m.apply({"type": "job_unregister", "job": "b", "reason": "done", "now": 1.0})
    # alone, "a" would get a partial share (half of 300 GB room: 100 of 200); it keeps FULL
    assert m.allocs["d"].option is Option.FULL and "kept full" in m.allocs["d"].reason
    assert not [e for e in effects if type(e).__name__ == "EvictDataset"]


def test_a_full_dataset_stays_full_when_offered_none_while_its_jobs_still_gain():
    # "d" is FULL; the other dataset's jobs now measure enough gain that the shared
    # LRU looks worth more than pinning "d" past its reserve: "d" keeps FULL (leaving
    # it would evict what its jobs read now) -- unless its jobs stop gaining
    m = ManagerModel(ManagerConfig(budget=300, probe=ProbeConfig(passive=True)))
    for j, d, size in (("a", "d", 200), ("b", "d", 200), ("c", "other", 200), ("c2", "other", 200)):
        m.apply({"type": "job_register", "job": j, "dataset": d, "dataset_bytes": size, "n_items": 100,
                 "n_gpus": 1, "now": 0.0})
    m.allocs["d"] = m.allocs["d"].__class__("d", Option.FULL, 200, 200, 1.0, "full", True, 200)
    for j, b in (("a", 1.2), ("b", 1.2), ("c", 2.0), ("c2", 2.0)):
        m.board.jobs[j].benefit = m.board.jobs[j].known_benefit = b
    effects = m.apply({"type": "tick", "now": 1.0})
    assert m.allocs["d"].option is Option.FULL and "kept full" in m.allocs["d"].reason
    assert not [e for e in effects if type(e).__name__ == "EvictDataset"]
    for j in ("a", "b"):
        m.board.jobs[j].benefit = m.board.jobs[j].known_benefit = 1.0
    m.apply({"type": "tick", "now": 2.0})
    assert m.allocs["d"].option is Option.NONE
