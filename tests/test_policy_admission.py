"""Admission to the shared LRU by measured reuse (manager/policy/admission.py), and
the passive benefit estimate that needs high-miss batches to say "no gain"
(manager/policy/probing.py), on traces measured in tools/bench/allocation and
synthetic ones."""
import itertools
import random

import pytest

from manager.model import ManagerConfig, ManagerModel
from manager.policy import Batch, Phase, ProbeConfig
from manager.policy.admission import AdmissionBoard, AdmissionConfig, SpareUse, spare_exclusions
from manager.policy.probing import JobProbe

# Measured in tools/bench/allocation (fig6, seed 0), all datasets inserting, 300 s after a
# 120 s settle: batches/s of each dataset's 4 jobs together and their hit fraction.
FIG6_30GB = [SpareUse("imagenet", 4, 309 / 300, 197 / 309), SpareUse("openimages", 4, 131 / 300, 15.4 / 131),
             SpareUse("librispeech", 4, 217 / 300, 155.8 / 217)]
FIG6_100GB = [SpareUse("imagenet", 4, 1.36, 0.78), SpareUse("openimages", 4, 0.98, 0.67),
              SpareUse("librispeech", 4, 0.75, 0.77)]


def test_the_dataset_whose_misses_yield_few_hits_stops_inserting():
    out = spare_exclusions(FIG6_30GB)
    assert list(out) == ["openimages"]
    assert "hit 12%" in out["openimages"]


def test_nobody_is_excluded_when_the_others_already_share_all_they_can():
    # at 100 GB the others hit more than the 3/4 four jobs can share: no room to gain
    assert spare_exclusions(FIG6_100GB) == {}
    # a client that shares perfectly (every job at 1 - 1/J): nobody gains from more room
    assert spare_exclusions([SpareUse(d, 4, 1.0, 0.75) for d in "abc"]) == {}


def test_at_most_all_but_one_and_idle_datasets_ignored():
    assert spare_exclusions([SpareUse("only", 4, 1.0, 0.01)]) == {}
    assert spare_exclusions([SpareUse("a", 4, 1.0, 0.01), SpareUse("idle", 4, 0.0, 0.0)]) == {}
    out = spare_exclusions([SpareUse("a", 4, 1.0, 0.01), SpareUse("b", 4, 1.0, 0.02), SpareUse("c", 8, 1.0, 0.5)])
    assert set(out) <= {"a", "b"} and "c" not in out


def test_the_margin_keeps_a_close_call_inserting():
    uses = [SpareUse("low", 4, 1.0, 0.30), SpareUse("high", 4, 1.0, 0.60)]
    # gain = min(0.6 * 0.7/0.4, (0.75 - 0.6) * 1) = 0.15 against a loss of 0.30: keep
    assert spare_exclusions(uses) == {}
    assert "low" in spare_exclusions([SpareUse("low", 4, 1.0, 0.05), SpareUse("high", 4, 1.0, 0.55)])


@pytest.mark.parametrize("seed", range(5))
def test_random_uses_never_exclude_a_dataset_the_others_cannot_replace(seed):
    rng = random.Random(seed)
    uses = [SpareUse(f"d{i}", rng.randint(1, 6), rng.uniform(0.1, 3), rng.uniform(0, 0.95)) for i in range(4)]
    out = spare_exclusions(uses)
    assert len(out) < len(uses)
    for name in out:  # the others had headroom worth more than what it loses
        d = next(u for u in uses if u.dataset == name)
        assert sum(u.headroom for u in uses if u.dataset not in out or u.dataset == name) > d.hits


# ------------------------------------------------------------- the state machine

def _feed(board, cfg, rates_hits, t0, t1, step=1.0):
    t = t0
    while t < t1:
        for ds, (rate, hit) in rates_hits.items():
            board.observe(ds, [Batch(t + step, step / rate, hit)] * round(rate), cfg)
        t += step


def test_board_measures_then_decides_and_resets_on_change():
    cfg = AdmissionConfig(settle_s=10, measure_s=50, min_batches=20)
    board = AdmissionBoard()
    jobs = {f"{d}{i}": d for d in ("big", "small") for i in range(4)}
    assert not board.step(jobs, ["big", "small"], 100, 0.0, cfg)
    use = {"big": (2.0, 0.05), "small": (2.0, 0.55)}
    _feed(board, cfg, use, 0.0, 60.0)
    assert not board.decided
    assert board.step(jobs, ["big", "small"], 100, 61.0, cfg)
    assert board.decided and list(board.excluded) == ["big"]
    # batches before the settle time were not counted
    assert board.acc["big"][0] == pytest.approx(2 * 50, abs=4)
    # nothing more is counted once decided; a restart restores the same state
    _feed(board, cfg, {"big": (2.0, 0.0)}, 61.0, 70.0)
    assert AdmissionBoard.from_dict(board.to_dict()) == board
    # a job joins: everyone inserts again and is measured again
    assert board.step({**jobs, "big4": "big"}, ["big", "small"], 100, 80.0, cfg)
    assert board.excluded == {} and not board.decided


def test_board_waits_for_enough_batches_and_can_be_disabled():
    cfg = AdmissionConfig(settle_s=0, measure_s=10, min_batches=50)
    board = AdmissionBoard()
    jobs = {"a": "a", "b": "b"}
    board.step(jobs, ["a", "b"], 1, 0.0, cfg)
    _feed(board, cfg, {"a": (1.0, 0.0), "b": (1.0, 0.6)}, 0.0, 20.0)
    assert not board.step(jobs, ["a", "b"], 1, 21.0, cfg) and not board.decided
    off = AdmissionConfig(enabled=False, settle_s=0, measure_s=1)
    board = AdmissionBoard()
    board.step(jobs, ["a", "b"], 1, 0.0, off)
    _feed(board, off, {"a": (1.0, 0.0), "b": (1.0, 0.6)}, 0.0, 100.0)
    board.step(jobs, ["a", "b"], 1, 101.0, off)
    assert board.excluded == {}


# ------------------------------------------------------------- in the model

def _model_run(admission: AdmissionConfig):
    m = ManagerModel(ManagerConfig(budget=30, probe=ProbeConfig(passive=True), admission=admission))
    sizes = {"imagenet": 154, "openimages": 531, "librispeech": 90}
    for name, n in itertools.product(sizes, range(4)):
        m.apply({"type": "job_register", "job": f"{name}{n}", "dataset": name, "dataset_bytes": sizes[name],
                 "n_items": sizes[name] * 10, "n_gpus": 4, "now": 0.0})
    use = {u.dataset: u for u in FIG6_30GB}
    rng = random.Random(7)
    due = {f"{name}{n}": rng.uniform(0, 4) for name, n in itertools.product(sizes, range(4))}
    for k in range(1, 601):
        t = float(k)
        for job in sorted(j for j, at in due.items() if at <= t):
            u = use[job.rstrip("0123456789")]
            period = u.jobs / u.rate   # each job's batch time, as measured
            h = min(1.0, max(0.0, rng.gauss(u.hit, 0.15)))
            m.apply({"type": "batches", "job": job, "batches": [[t, period * (0.7 + 0.6 * (1 - h)), h]], "now": t})
            due[job] = t + period
        if k % 10 == 0:
            m.apply({"type": "tick", "now": t})
    return m


def test_model_keeps_the_low_reuse_dataset_out_of_the_lru_and_journals_it():
    m = _model_run(AdmissionConfig(settle_s=60, measure_s=300))
    assert not m.plan("openimages")["spare"] and "inserts nothing" in m.allocs["openimages"].reason
    assert m.plan("imagenet")["spare"] and m.plan("librispeech")["spare"]
    assert ManagerModel.from_dict(m.to_dict()).digest() == m.digest()
    # a job leaves: the measurement starts over with everyone inserting
    m.apply({"type": "job_unregister", "job": "imagenet0", "reason": "done", "now": 700.0})
    assert m.plan("openimages")["spare"]
    off = _model_run(AdmissionConfig(enabled=False))
    assert off.plan("openimages")["spare"]


# ------------------------------------------------------------- "no gain" needs evidence

def test_flat_times_at_low_miss_fractions_are_a_lower_bound_and_get_a_probe():
    cfg = ProbeConfig(passive=True)
    job = JobProbe("j", "d", 1)
    rng = random.Random(5)
    t = 0.0
    for _ in range(100):   # misses 0-75%: the loader hides them, every batch at compute speed
        m = rng.choice([0.0, 0.25, 0.5, 0.75])
        t += 5.3
        job.report([Batch(t, 5.3 * rng.uniform(0.98, 1.02), 1.0 - m)], t, cfg)
    assert job.phase is Phase.DECIDED and job.benefit < 1.05
    assert job.inconclusive and job.known_benefit is None
    assert job.gain(cfg).benefit >= cfg.prior_benefit   # not "no gain" for allocation
    assert job.due(t, cfg)                              # one bypass probe settles it


def test_flat_times_seen_at_high_miss_fractions_are_no_gain():
    cfg = ProbeConfig(passive=True)
    job = JobProbe("j", "d", 1)
    rng = random.Random(6)
    t = 0.0
    for _ in range(100):
        m = rng.random()
        t += 8.0
        job.report([Batch(t, 8.0 * rng.uniform(0.98, 1.02), 1.0 - m)], t, cfg)
    assert not job.inconclusive and job.known_benefit < 1.05 and not job.due(t, cfg)


def _flat_job(job, cfg, seed):
    rng = random.Random(seed)
    t = 0.0
    for _ in range(100):
        m = rng.choice([0.0, 0.25, 0.5, 0.75])
        t += 5.3
        job.report([Batch(t, 5.3 * rng.uniform(0.98, 1.02), 1.0 - m)], t, cfg)
    return t


def test_flat_jobs_are_not_probed_once_a_job_of_their_dataset_is_known_to_gain():
    from manager.policy import ProbeBoard
    cfg = ProbeConfig(passive=True)
    board = ProbeBoard(cfg)
    for j in ("a", "b"):
        board.add_job(j, "d", 1, 0.0)
    t = _flat_job(board.jobs["a"], cfg, 1)
    _flat_job(board.jobs["b"], cfg, 2)
    assert [tr.job_id for tr in board.tick(t)] == ["a"]         # one at a time per dataset
    board.jobs["a"].known_benefit = 2.0                          # its probe found a gain
    board.jobs["a"].phase = Phase.DECIDED
    assert board.tick(t + 1) == []                               # "b" needs no probe of its own


def test_a_job_cached_whole_with_a_known_benefit_is_not_probed_again():
    cfg = ProbeConfig(passive=True, passive_probe_after=50)
    job = JobProbe("j", "d", 1)
    job.benefit = job.known_benefit = 3.0
    job.phase = Phase.DECIDED
    for k in range(60):   # all hits: nothing to regress
        job.report([Batch(k + 1.0, 1.0, 1.0)], k + 1.0, cfg)
    assert not job.due(61.0, cfg)


def test_policy_config_sets_admission_and_refuses_unknown_sections(tmp_path):
    import json

    from manager.managerd import build_parser, config_from_args
    f = tmp_path / "policy.json"
    f.write_text(json.dumps({"admission": {"enabled": False, "settle_s": 30}}))
    args = build_parser().parse_args(["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                                      "--policy-config", str(f)])
    cfg = config_from_args(args)
    assert cfg.model.admission == AdmissionConfig(enabled=False, settle_s=30)
    f.write_text(json.dumps({"admision": {}}))
    with pytest.raises(ValueError, match="unknown sections"):
        config_from_args(args)


@pytest.mark.parametrize("bad", [{"settle_s": -1}, {"measure_s": float("nan")}, {"margin": -0.1},
                                 {"min_batches": 0}])
def test_bad_admission_config_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AdmissionConfig(**bad)
