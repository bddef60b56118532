import json
import random

import pytest

from manager.policy.probing import (DEFAULT_PRIOR_BENEFIT, Batch, CacheMode, JobGain, JobProbe,
                                    Phase, ProbeBoard, ProbeConfig, dataset_gain, job_benefit,
                                    relative_stderr, robust_mean)


def batches(t0: float, n: int, dur, hit=None, rng=None, noise=0.0):
    """n back-to-back batches starting at t0; dur a float or a callable(i)."""
    out, t = [], t0
    for i in range(n):
        d = dur(i) if callable(dur) else dur
        if rng is not None and noise:
            d *= 1 + rng.uniform(-noise, noise)
        t += d
        out.append(Batch(end=t, duration=d, hit_ratio=hit))
    return out, t


def run_probe(board, job, t, t_miss, t_hit, hit=None, rng=None, noise=0.0, chunk=10):
    """Feed batches in small reports until the job leaves its probe; returns time."""
    for _ in range(10_000):
        j = board.jobs[job]
        if not j.probing:
            return t
        dur = t_miss if j.phase is Phase.PROBE_BYPASS else t_hit
        bs, t = batches(t, chunk, dur, hit=hit, rng=rng, noise=noise)
        board.report(job, bs, t)
    raise AssertionError("probe never finished")


# ---------------------------------------------------------------- functions

def test_job_benefit():
    assert job_benefit(3.0, 1.0) == 3.0
    assert job_benefit(1.0, 2.0) == 1.0        # clamped: caching never slows a job
    for bad in [(0, 1), (1, 0), (-1, 1), (float("inf"), 1), (float("nan"), 1)]:
        with pytest.raises(ValueError):
            job_benefit(*bad)


def test_dataset_gain_and_prior():
    jobs = [JobGain("a", 4, 3.0), JobGain("b", 2, 1.0), JobGain("c", 1, None)]
    assert dataset_gain(jobs) == pytest.approx(12 + 2 + DEFAULT_PRIOR_BENEFIT)
    assert dataset_gain(jobs, prior_benefit=2.0) == pytest.approx(16)
    assert dataset_gain([]) == 0.0
    assert JobGain("x", 2, 0.5).g() == 2.0      # a benefit < 1 counts as 1


def test_robust_mean():
    assert robust_mean([1, 2, 3]) == 2
    assert robust_mean([1, 2, 3, 4], trim=0.5) == 2.5
    xs = [1.0] * 18 + [100.0, 0.0]
    assert robust_mean(xs, 0.1) == 1.0           # outliers cut from both ends
    with pytest.raises(ValueError):
        robust_mean([])
    assert relative_stderr([1.0] * 30) == 0.0
    assert relative_stderr([1.0]) == float("inf")


# ---------------------------------------------------------------- state machine

def test_full_cycle_io_bound_job():
    cfg = ProbeConfig()
    board = ProbeBoard(cfg)
    tr = board.add_job("j1", "imagenet", 4, now=0.0)
    assert [(t.old, t.new) for t in tr] == [(Phase.NEW, Phase.PROBE_BYPASS)]
    assert board.modes() == {"j1": CacheMode.BYPASS}
    t = run_probe(board, "j1", 0.0, 0.3, 0.1, rng=random.Random(1), noise=0.05)
    j = board.jobs["j1"]
    assert j.phase is Phase.DECIDED and j.mode is CacheMode.NORMAL
    assert j.benefit == pytest.approx(3.0, rel=0.05)
    assert not j.inconclusive and j.probes == 1
    assert t + cfg.reprobe_interval_s <= j.next_probe_at <= t + cfg.reprobe_interval_s * 1.1 + 1
    assert board.dataset_gains()["imagenet"] == pytest.approx(12.0, rel=0.05)


def test_warmup_and_pre_switch_batches_are_dropped():
    cfg = ProbeConfig(warmup_batches=3, min_batches=10, max_batches=10)
    j = JobProbe("j", "d", 1)
    j.start_probe(100.0, cfg)
    # batches that started before the switch (still run under the old mode): dropped
    old, _ = batches(95.0, 5, 1.0)
    j.report(old, 100.0, cfg)
    assert j.samples == [] and j.skip == 3
    # three warm-up batches (prefetched under the old mode: fast) are dropped, then 10 steady
    warm, t = batches(100.0, 3, 0.01)
    steady, t = batches(t, 10, 0.5)
    tr = j.report(warm + steady, t, cfg)
    assert tr[0].new is Phase.MEASURE_NORMAL
    assert j.probe_t_miss == pytest.approx(0.5)


def test_outliers_do_not_move_the_estimate():
    cfg = ProbeConfig(min_batches=100, max_batches=100)
    j = JobProbe("j", "d", 1)
    j.start_probe(0.0, cfg)
    # 5% huge outliers (checkpoint saves, eval passes)
    bs, t = batches(0.0, 105, lambda i: 30.0 if i % 20 == 7 else 0.2)
    j.report(bs, t, cfg)
    assert j.probe_t_miss == pytest.approx(0.2)


def test_precision_stops_early_noise_runs_longer():
    cfg = ProbeConfig()
    steady = JobProbe("a", "d", 1)
    steady.start_probe(0.0, cfg)
    bs, t = batches(0.0, 200, 0.2)
    steady.report(bs[: cfg.warmup_batches + cfg.min_batches], t, cfg)
    assert steady.phase is Phase.MEASURE_NORMAL     # constant times: precise at min_batches

    noisy = JobProbe("b", "d", 1)
    noisy.start_probe(0.0, cfg)
    rng = random.Random(7)
    bs, t = batches(0.0, cfg.warmup_batches + cfg.max_batches, 0.2, rng=rng, noise=0.9)
    for i, b in enumerate(bs):
        noisy.report([b], b.end, cfg)
        if noisy.phase is Phase.MEASURE_NORMAL:
            break
    assert cfg.min_batches < i + 1 - cfg.warmup_batches <= cfg.max_batches


def test_compute_bound_job_gets_b_one():
    board = ProbeBoard()
    board.add_job("j", "d", 8, 0.0)
    run_probe(board, "j", 0.0, 0.5, 0.52, rng=random.Random(3), noise=0.03)
    assert board.jobs["j"].benefit == pytest.approx(1.0, abs=0.03)


def test_reprobe_after_interval_and_old_benefit_kept_meanwhile():
    cfg = ProbeConfig(reprobe_interval_s=1000, reprobe_jitter=0.0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 1, 0.0)
    t = run_probe(board, "j", 0.0, 0.3, 0.1)
    assert board.tick(t + 999) == []
    tr = board.tick(t + 1000)
    assert [(x.old, x.new, x.reason) for x in tr] == [(Phase.DECIDED, Phase.PROBE_BYPASS, "re-probe")]
    assert board.jobs["j"].effective_benefit() == pytest.approx(3.0)   # still counts
    run_probe(board, "j", t + 1000, 0.2, 0.1)                          # store got faster
    assert board.jobs["j"].benefit == pytest.approx(2.0)
    assert board.jobs["j"].probes == 2


def test_jitter_is_deterministic_and_bounded():
    cfg = ProbeConfig()
    nexts = []
    for jid in ("a", "b", "c", "a"):
        b = ProbeBoard(cfg)
        b.add_job(jid, "d", 1, 0.0)
        t = run_probe(b, jid, 0.0, 0.3, 0.1)
        nexts.append(b.jobs[jid].next_probe_at - t)
    assert nexts[0] == nexts[3]
    assert len(set(nexts[:3])) == 3
    assert all(cfg.reprobe_interval_s <= x <= cfg.reprobe_interval_s * 1.1 for x in nexts)


def test_invalidate():
    board = ProbeBoard()
    board.add_job("j", "d", 1, 0.0)
    t = run_probe(board, "j", 0.0, 0.3, 0.1)
    tr = board.invalidate(t + 5, "store load changed", dataset="other")
    assert tr == []
    tr = board.invalidate(t + 5, "store load changed", dataset="d")
    assert tr[-1].new is Phase.PROBE_BYPASS
    # mid-probe (fewer batches than the phase needs): restart with fresh samples
    cfg = board.config
    bs, t2 = batches(t + 5, cfg.warmup_batches + cfg.min_batches - 3, 0.3)
    board.report("j", bs, t2)
    assert board.jobs["j"].samples
    tr = board.invalidate(t2, "job mix changed")
    assert tr[0].new is Phase.PROBE_BYPASS and tr[0].reason.startswith("restart")
    assert board.jobs["j"].samples == []


def test_one_probe_per_dataset_at_a_time():
    board = ProbeBoard()
    board.add_job("a1", "A", 1, 0.0)
    board.add_job("a2", "A", 1, 0.0)
    board.add_job("b1", "B", 1, 0.0)
    assert board.modes() == {"a1": CacheMode.BYPASS, "a2": CacheMode.NORMAL, "b1": CacheMode.BYPASS}
    assert board.jobs["a2"].phase is Phase.NEW
    t = run_probe(board, "a1", 0.0, 0.3, 0.1)
    assert board.jobs["a2"].phase is Phase.PROBE_BYPASS     # slot freed, a2 starts
    # removing a probing job frees its slot too
    board.add_job("a3", "A", 1, t)
    assert board.jobs["a3"].phase is Phase.NEW
    board.remove_job("a2", t + 1)
    assert board.jobs["a3"].phase is Phase.PROBE_BYPASS
    assert board.report("a2", batches(t, 3, 0.1)[0], t + 2) == []   # late report of a removed job


def test_stalled_probe_is_aborted_and_retried():
    cfg = ProbeConfig(max_phase_s=100, retry_after_abort_s=50)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 1, 0.0)
    tr = board.tick(100.0)
    assert [(x.old, x.new) for x in tr] == [(Phase.PROBE_BYPASS, Phase.NEW)]
    assert board.modes()["j"] is CacheMode.NORMAL and board.jobs["j"].aborts == 1
    assert board.tick(149.0) == []
    assert board.tick(150.0)[0].new is Phase.PROBE_BYPASS


def test_slow_phase_finishes_on_time_limit_with_enough_samples():
    cfg = ProbeConfig(max_phase_s=100, min_batches=20, max_batches=1000)
    j = JobProbe("j", "d", 1)
    j.start_probe(0.0, cfg)
    rng = random.Random(2)
    bs, t = batches(0.0, cfg.warmup_batches + 30, 1.0, rng=rng, noise=0.9)
    j.report(bs, t, cfg)
    assert j.phase is Phase.PROBE_BYPASS     # noisy: not precise yet
    tr = j.tick(100.0, cfg)
    assert tr[0].new is Phase.MEASURE_NORMAL and "time limit" in tr[0].reason


def test_abort_after_decision_keeps_old_benefit():
    cfg = ProbeConfig(max_phase_s=100, reprobe_interval_s=10, reprobe_jitter=0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 2, 0.0)
    t = run_probe(board, "j", 0.0, 0.3, 0.1)
    board.tick(t + 10)
    tr = board.tick(t + 10 + 100)
    assert tr[0].new is Phase.DECIDED and tr[0].reason.startswith("probe aborted")
    assert board.jobs["j"].benefit == pytest.approx(3.0)


def test_inconclusive_when_normal_phase_had_few_hits():
    cfg = ProbeConfig(reprobe_jitter=0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 2, 0.0)
    # dataset not cached: normal == miss time, hit ratio ~0
    t = run_probe(board, "j", 0.0, 0.3, 0.3, hit=0.05)
    j = board.jobs["j"]
    assert j.inconclusive and j.benefit == pytest.approx(1.0)
    assert j.effective_benefit() == DEFAULT_PRIOR_BENEFIT        # lower bound -> prior
    assert j.next_probe_at == pytest.approx(t + cfg.inconclusive_reprobe_s)
    assert board.job_gains()["d"] == [JobGain("j", 2, DEFAULT_PRIOR_BENEFIT, lower_bound=True)]
    # the dataset got cached: hit ratio rises -> re-measure before the timer
    bs, t2 = batches(t, cfg.drift_window, 0.3, hit=0.97)
    tr = board.report("j", bs, t2)
    assert tr[-1].new is Phase.PROBE_BYPASS
    run_probe(board, "j", t2, 0.3, 0.1, hit=0.97)
    assert not j.inconclusive and j.benefit == pytest.approx(3.0)


def test_drift_triggers_reprobe():
    cfg = ProbeConfig(drift_window=20)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 1, 0.0)
    t = run_probe(board, "j", 0.0, 0.3, 0.1)
    bs, t = batches(t, 40, 0.11)                 # +10%: no drift
    assert board.report("j", bs, t) == []
    bs, t = batches(t, 20, 0.2)                  # doubled: store load changed
    tr = board.report("j", bs, t)
    assert [x.reason.split(":")[0] for x in tr] == ["drift", "re-probe"]
    assert board.jobs["j"].phase is Phase.PROBE_BYPASS


def test_bad_durations_ignored_and_config_checked():
    cfg = ProbeConfig(warmup_batches=0, min_batches=2, max_batches=2)
    j = JobProbe("j", "d", 1)
    j.start_probe(0.0, cfg)
    j.report([Batch(1.0, 0.0), Batch(2.0, float("inf")), Batch(3.0, -1.0)], 3.0, cfg)
    assert j.samples == []
    with pytest.raises(ValueError):
        ProbeConfig(min_batches=10, max_batches=5)
    with pytest.raises(ValueError):
        ProbeBoard().add_job("x", "d", 0, 0.0)


def test_json_roundtrip_mid_probe_continues_identically():
    board = ProbeBoard(ProbeConfig(drift_window=10))
    rng = random.Random(5)
    board.add_job("a", "A", 4, 0.0)
    board.add_job("b", "A", 2, 0.0)
    bs, t = batches(0.0, 37, 0.3, rng=rng, noise=0.2)
    board.report("a", bs, t)
    board.report("b", bs[:10], t)
    restored = ProbeBoard.from_dict(json.loads(json.dumps(board.to_dict())))
    assert restored == board
    rest, t2 = batches(t, 300, 0.25, rng=rng, noise=0.2)
    for i in range(0, 300, 7):
        tr1 = board.report("a", rest[i:i + 7], rest[min(i + 6, 299)].end)
        tr2 = restored.report("a", rest[i:i + 7], rest[min(i + 6, 299)].end)
        assert [x.to_dict() for x in tr1] == [x.to_dict() for x in tr2]
    assert restored == board
    assert restored.to_dict() == board.to_dict()


@pytest.mark.parametrize("t_miss,t_normal,h,inconclusive,b", [
    (1.0, 0.98, 0.5, False, 1.0 / 0.98),   # half the I/O gone, no speed-up: compute floor
    (0.3, 0.1, 0.75, False, 3.0),          # faster than (1-h)*t_miss predicts: floor reached
    (0.4, 0.2, 0.5, True, 2.0),            # still proportional to misses: lower bound only
    (0.3, 0.3, 0.1, True, 1.0),            # too few hits to tell
    (0.3, 0.1, 0.95, False, 3.0),          # a hit run
    (0.3, 0.1, None, False, 3.0),          # no hit ratio reported: the paper's rule
])
def test_partial_hit_interpretation(t_miss, t_normal, h, inconclusive, b):
    cfg = ProbeConfig(warmup_batches=0, min_batches=5, max_batches=5)
    j = JobProbe("j", "d", 1)
    j.start_probe(0.0, cfg)
    bs, t = batches(0.0, 5, t_miss)
    j.report(bs, t, cfg)
    bs, t = batches(t, 5, t_normal, hit=h)
    j.report(bs, t, cfg)
    assert j.phase is Phase.DECIDED
    assert j.inconclusive is inconclusive
    assert j.benefit == pytest.approx(b)
    assert j.effective_benefit() == pytest.approx(max(b, DEFAULT_PRIOR_BENEFIT) if inconclusive else b)


def test_inconclusive_probe_keeps_earlier_conclusive_benefit():
    cfg = ProbeConfig(reprobe_jitter=0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 2, 0.0)
    t = run_probe(board, "j", 0.0, 1.02, 1.0, hit=0.5)     # compute-bound, measured with space
    j = board.jobs["j"]
    assert not j.inconclusive and j.known_benefit == pytest.approx(1.02)
    board.invalidate(t, "store load changed")
    run_probe(board, "j", t, 1.02, 1.02, hit=0.0)           # dataset lost its space: no hits
    assert j.inconclusive and j.benefit == pytest.approx(1.0)
    assert j.effective_benefit() == pytest.approx(1.02)      # not reset to the prior
    assert board.job_gains()["d"][0].lower_bound is False


# ---------------------------------------------------------------- back-off of inconclusive probes

def _passive_flat_run(board, until, rng):
    """A passive job whose dataset is never cached: flat batch times at 0-75% misses
    (regression: b < 1.05, a lower bound), and every probe's normal phase has few hits
    (inconclusive). Returns the times probes started."""
    starts, t = [], 0.0
    while t < until:
        j = board.jobs["j"]
        if j.phase is Phase.PROBE_BYPASS:
            d, h = 1.0, 0.0
        elif j.phase is Phase.MEASURE_NORMAL:
            d, h = 1.0, 0.05
        else:
            d, h = rng.uniform(0.98, 1.02), 1.0 - rng.choice([0.0, 0.25, 0.5, 0.75])
        t += d
        for tr in board.report("j", [Batch(t, d, h)], t):
            if tr.new is Phase.PROBE_BYPASS and tr.old is not Phase.PROBE_BYPASS:
                starts.append(t)
    return starts


def test_a_flat_passive_job_whose_probes_are_inconclusive_backs_off():
    cfg = ProbeConfig(passive=True, warmup_batches=0, min_batches=5, max_batches=10,
                      inconclusive_reprobe_s=100.0, reprobe_interval_s=500.0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 1, 0.0)
    starts = _passive_flat_run(board, 2000.0, random.Random(1))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # each probe takes ~10 batches (10 s); the waits after it: 100, 200, 400, then 500 (the cap)
    assert len(starts) == 6, starts
    for gap, wait in zip(gaps, (100, 200, 400, 500, 500)):
        assert wait <= gap <= wait + 15, (gaps, starts)
    assert board.jobs["j"].inconclusive_probes == 6  # all of them


def test_inconclusive_backoff_is_a_pure_function_of_the_count():
    from manager.policy.probing import inconclusive_backoff
    cfg = ProbeConfig(inconclusive_reprobe_s=300.0, reprobe_interval_s=1800.0)
    assert [inconclusive_backoff(cfg, n) for n in (1, 2, 3, 4, 5, 1000)] == [300, 600, 1200, 1800, 1800, 1800]
    # an interval below the first wait never shortens it
    assert inconclusive_backoff(ProbeConfig(inconclusive_reprobe_s=300.0, reprobe_interval_s=10.0), 3) == 300


def test_a_conclusive_probe_resets_the_backoff_and_the_count_survives_a_roundtrip():
    cfg = ProbeConfig(reprobe_jitter=0, inconclusive_reprobe_s=100.0, reprobe_interval_s=1000.0)
    board = ProbeBoard(cfg)
    board.add_job("j", "d", 1, 0.0)
    t = run_probe(board, "j", 0.0, 0.3, 0.3, hit=0.05)   # not cached: inconclusive
    j = board.jobs["j"]
    assert j.inconclusive_probes == 1 and j.next_probe_at == pytest.approx(t + 100.0)
    board.tick(t + 100.0)
    t = run_probe(board, "j", t + 100.0, 0.3, 0.3, hit=0.05)
    assert j.inconclusive_probes == 2 and j.next_probe_at == pytest.approx(t + 200.0)
    again = ProbeBoard.from_dict(json.loads(json.dumps(board.to_dict())))
    assert again.jobs["j"].inconclusive_probes == 2 and again.to_dict() == board.to_dict()
    board.tick(t + 200.0)
    run_probe(board, "j", t + 200.0, 0.3, 0.1, hit=0.97)  # cached now: conclusive
    assert j.inconclusive_probes == 0 and not j.inconclusive


def test_a_passive_probe_that_aborts_waits_before_the_next():
    cfg = ProbeConfig(passive=True, max_phase_s=100, retry_after_abort_s=50)
    job = JobProbe("j", "d", 1)
    job.benefit, job.inconclusive, job.phase = 1.0, True, Phase.DECIDED   # flat lower bound: due
    assert job.due(0.0, cfg)
    job.start_probe(0.0, cfg)
    job.tick(100.0, cfg)                      # stalled: aborted
    assert job.phase is Phase.DECIDED and job.aborts == 1
    assert not job.due(149.0, cfg) and job.due(150.0, cfg)
