"""Benefit-aware probing (Quiver section 5.3): how much faster does a job run
with the cache than without it?

Per job, an explicit state machine fed with measured mini-batch times. No I/O,
no clocks: every call takes ``now`` (seconds, the daemon's clock).

States and transitions (``mode`` is what the servers must apply to the job)::

    NEW (mode normal)
      -- probe slot free for its dataset (ProbeBoard) ----------> PROBE_BYPASS
    PROBE_BYPASS (mode bypass: servers answer every lookup with a miss)
      -- enough steady samples (precision reached or max) ------> MEASURE_NORMAL
      -- max_phase_s passed, >= min_batches samples -------------> MEASURE_NORMAL
      -- max_phase_s passed, too few samples (job stalled) ------> NEW / DECIDED
                                   (probe aborted, old decision kept, retry later)
    MEASURE_NORMAL (mode normal)
      -- enough steady samples ----------------------------------> DECIDED
      -- max_phase_s passed: finish or abort, as above ----------> DECIDED / NEW
    DECIDED (mode normal; benefit known)
      -- next_probe_at reached (re-probe interval, jittered) ----> PROBE_BYPASS*
      -- invalidate(): job mix / store load changed -------------> PROBE_BYPASS*
      -- drift: steady normal time moved > drift_threshold ------> PROBE_BYPASS*
      -- inconclusive and hit ratio now >= min_hit_ratio --------> PROBE_BYPASS*
    * via the ProbeBoard, which lets at most ``max_concurrent_per_dataset`` jobs
      of one dataset probe at once; a due job waits in DECIDED/NEW meanwhile.
    invalidate() during a probe restarts it at PROBE_BYPASS (old samples were
    taken under the old conditions).

Measurements. After each mode switch the first ``warmup_batches`` batches are
dropped, and so is any batch that *started* before the switch: the data loader
prefetches several batches ahead, so the first batches after a switch were
fetched under the previous mode; the first batches of a job also carry start-up
costs (cuDNN autotuning, compilation, worker spawn). The phase value is a
trimmed mean (10% cut from each end by default): mini-batch times are nearly
constant (Quiver section 3) but have rare large outliers -- checkpoint saves,
evaluation passes, epoch boundaries, GC -- that would drag a plain mean, while a
trimmed mean keeps more information than the median. A phase ends early once the
estimate is precise enough (MAD-based standard error / median <= rel_precision,
after ``min_batches``), which shortens the time a job spends slowed down in
bypass; ``max_batches`` (the paper's fixed P = 100) caps it.

Benefit. ``b = t_miss / t_hit`` clamped to >= 1 (caching never makes a job
slower: the client can always bypass). The paper measures the "normal" phase
under whatever is cached at the time; if the dataset is not (fully) cached, the
normal time is not a cache-hit time and the benefit is underestimated -- so a
dataset measured while uncached would look useless and never get the space to
prove otherwise. When clients report per-batch hit ratios ``h`` we use them,
with the pipelined-loader model ``t = max(compute, (1 - h) * io_miss)``:

* ``h`` unknown, or ``h >= min_hit_ratio``: a hit run; ``t_hit = t_normal``.
* ``t_normal > (1 - h) * t_miss * (1 + compute_floor_margin)``: removing a
  fraction ``h`` of the I/O did not make the batch proportionally faster, so
  the job already sits on its compute floor: ``t_hit = t_normal`` (conclusive;
  this is how a compute-bound job on a partly cached dataset gets b ~ 1).
* otherwise (``h < min_informative_hit_ratio``, or the time is still
  proportional to the misses): ``b`` is only a *lower bound*; the result is
  ``inconclusive`` and counts in allocation as at least the job's last
  conclusive benefit or, if it never had one, the prior (so the dataset is
  offered exploration space); the job re-probes sooner
  (``inconclusive_reprobe_s``), or as soon as its hit ratio reaches
  ``min_hit_ratio``.

Back-off. Each further inconclusive probe in a row doubles the wait before the
next one (``inconclusive_backoff``: ``inconclusive_reprobe_s`` x 2^(n-1), at most
``reprobe_interval_s``); a conclusive measurement resets the count
(``inconclusive_probes``, kept in the state). In passive mode a job is probed
only when due *and* past ``next_probe_at``: a flat job whose probe says nothing
new (its dataset is still not cached) would otherwise be probed again at once,
and run in bypass over and over.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Any, Iterable, Mapping

from cacheserver.vocab import CacheMode

from .regression import regress_benefit

#: Benefit assumed for a job with no measurement yet: a little above the
#: no-benefit threshold (1.05 in allocation), so a new dataset ranks below any
#: dataset measured to benefit clearly, but can still take spare space and be probed.
DEFAULT_PRIOR_BENEFIT = 1.1

#: A reported mini-batch longer than this (11.6 days) is a broken report, not a
#: measurement; it is dropped: far larger ones (the manager accepts any finite
#: value) overflowed the statistics (OverflowError, or an infinite phase time).
MAX_BATCH_S = 1e6


class Phase(str, Enum):
    NEW = "new"
    PROBE_BYPASS = "probe_bypass"
    MEASURE_NORMAL = "measure_normal"
    DECIDED = "decided"


@dataclass(frozen=True)
class Batch:
    """One reported mini-batch. ``end``: when it finished, on the daemon's
    clock; ``duration``: seconds; ``hit_ratio``: cache hits / lookups for the
    batch if the client reports it (None: unknown)."""
    end: float
    duration: float
    hit_ratio: float | None = None


@dataclass(frozen=True)
class ProbeConfig:
    warmup_batches: int = 5          # dropped after every mode switch
    # Every bypass batch runs at the store's speed, so a steady job may stop after
    # 10 (tools/bench/allocation). Noisy jobs still run
    # until rel_precision holds; 2% there misjudged noisy jobs by 9% in
    # tests/test_policy_trace.py, so it stays 1%.
    min_batches: int = 10            # steady samples before a phase may end early
    max_batches: int = 100           # the paper's P
    rel_precision: float = 0.01      # stop when std-error/median <= this
    trim: float = 0.1                # trimmed-mean cut per side (>= 0.5: median)
    max_phase_s: float = 900.0       # a phase never lasts longer than this
    reprobe_interval_s: float = 1800.0
    reprobe_jitter: float = 0.1      # +0..10% per job, deterministic, spreads probes
    inconclusive_reprobe_s: float = 300.0  # doubled per further inconclusive probe (inconclusive_backoff)
    retry_after_abort_s: float = 300.0
    drift_window: int = 50           # normal batches compared against the decision
    drift_threshold: float = 0.25    # relative change that triggers a re-probe
    min_hit_ratio: float = 0.8       # at or above: normal phase was a cache-hit run
    min_informative_hit_ratio: float = 0.2  # below: too few hits to learn anything
    compute_floor_margin: float = 0.1
    prior_benefit: float = DEFAULT_PRIOR_BENEFIT
    max_concurrent_per_dataset: int = 1  # probes of one dataset at a time
    # passive: benefit from regressing batch time on the miss fraction
    # (regression.py), no bypass; a job is probed in bypass only after
    # ``passive_probe_after`` batches without a confident estimate.
    passive: bool = False
    passive_window: int = 300        # (miss fraction, time) pairs kept per job
    passive_every: int = 25          # re-estimate after this many new pairs
    # until a job's first estimate: try every passive_first_every pairs from
    # passive_first_n on, so allocation acts within a few batches of a job's start
    # (the fit's spread and standard-error checks still guard a noisy one)
    passive_first_every: int = 5
    passive_first_n: int = 15
    passive_probe_after: int = 600
    # the estimate of b is conclusive only with this share of pairs at or above this
    # miss fraction; otherwise it is a lower bound (counts as at least the prior)
    passive_high_miss: float = 0.8
    passive_high_share: float = 0.1
    # such a lower bound below this (no gain as far as seen) gets one bypass probe:
    # allocation would otherwise keep the dataset out of the cache on no evidence
    passive_probe_below: float = 1.05

    def __post_init__(self) -> None:
        if self.min_batches < 1 or self.max_batches < self.min_batches:
            raise ValueError("need 1 <= min_batches <= max_batches")
        if self.warmup_batches < 0 or self.max_concurrent_per_dataset < 1:
            raise ValueError("warmup_batches >= 0 and max_concurrent_per_dataset >= 1")
        if not 0 <= self.trim <= 0.5:
            raise ValueError("trim must be in [0, 0.5]")


# ---------------------------------------------------------------- statistics

def robust_mean(xs: Iterable[float], trim: float = 0.1) -> float:
    """Mean of ``xs`` after cutting ``floor(n*trim)`` values from each end;
    ``trim >= 0.5`` gives the median. Raises ValueError on no data."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("robust_mean of no data")
    if trim >= 0.5:
        mid = n // 2
        return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
    cut = int(n * trim)
    kept = s[cut:n - cut]
    return sum(kept) / len(kept)


def _median(xs: Iterable[float]) -> float:
    return robust_mean(xs, 0.5)


def relative_stderr(xs: list[float]) -> float:
    """Robust standard error of the centre relative to the centre: sigma is
    estimated as 1.4826*MAD, the error of a median as 1.2533*sigma/sqrt(n)."""
    if len(xs) < 2:
        return math.inf
    m = _median(xs)
    if m <= 0:
        return math.inf
    mad = _median(abs(x - m) for x in xs)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(xs)) / m


# ---------------------------------------------------------------- benefit

def job_benefit(t_miss: float, t_hit: float) -> float:
    """Speed-up from caching, ``t_miss / t_hit``, never below 1."""
    if not (t_miss > 0 and t_hit > 0) or math.isinf(t_miss) or math.isinf(t_hit):
        raise ValueError(f"mini-batch times must be positive and finite: {t_miss}, {t_hit}")
    return max(1.0, t_miss / t_hit)


@dataclass(frozen=True)
class JobGain:
    """A job's input to the allocator: GPUs and benefit (None: not measured;
    ``lower_bound``: measured without enough cache hits to be sure)."""
    job_id: str
    n_gpus: int
    benefit: float | None = None
    lower_bound: bool = False

    def g(self, prior_benefit: float = DEFAULT_PRIOR_BENEFIT) -> float:
        """``g = b * n_gpus``; an unmeasured job counts with the prior."""
        b = self.benefit if self.benefit is not None else prior_benefit
        return max(1.0, b) * self.n_gpus


def dataset_gain(jobs: Iterable[JobGain], prior_benefit: float = DEFAULT_PRIOR_BENEFIT) -> float:
    """``G = sum(g_i)`` over the dataset's jobs; 0.0 for no jobs."""
    return sum(j.g(prior_benefit) for j in jobs)


# ---------------------------------------------------------------- per-job machine

@dataclass
class Transition:
    """A state change, for the daemon to act on (``mode``) and to log (``reason``)."""
    job_id: str
    old: Phase
    new: Phase
    mode: CacheMode
    reason: str
    at: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["old"], d["new"], d["mode"] = self.old.value, self.new.value, self.mode.value
        return d


def _lower_bound_only(t_miss: float, t_normal: float, h: float | None, cfg: ProbeConfig) -> bool:
    """True when the normal phase says only "b >= t_miss/t_normal" (module docstring)."""
    if h is None or h >= cfg.min_hit_ratio:
        return False
    if h < cfg.min_informative_hit_ratio:
        return True
    # pipelined loader: t = max(compute, (1-h)*io_miss); above the I/O line = compute floor
    return t_normal <= (1.0 - h) * t_miss * (1.0 + cfg.compute_floor_margin)


def inconclusive_backoff(cfg: ProbeConfig, n: int) -> float:
    """Seconds until the next probe after ``n`` (>= 1) inconclusive probes in a row:
    ``inconclusive_reprobe_s`` doubled for each one after the first, capped at the
    re-probe interval of a conclusive job (never below the first wait)."""
    cap = max(cfg.inconclusive_reprobe_s, cfg.reprobe_interval_s)
    return min(cap, cfg.inconclusive_reprobe_s * 2.0 ** min(max(0, n - 1), 62))


def _jitter_frac(job_id: str) -> float:
    # crc32, not hash(): the same across processes and restarts.
    return (zlib.crc32(job_id.encode()) % 10_000) / 10_000


@dataclass
class JobProbe:
    job_id: str
    dataset: str
    n_gpus: int
    phase: Phase = Phase.NEW
    phase_since: float | None = None
    skip: int = 0                       # warm-up batches still to drop this phase
    samples: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    probe_t_miss: float | None = None   # bypass result of the probe in progress
    t_miss: float | None = None         # last decided values
    t_hit: float | None = None          # normal-mode time (a true t_hit if hit_ratio high)
    hit_ratio: float | None = None
    benefit: float | None = None        # last measured b (a lower bound if inconclusive)
    inconclusive: bool = False
    known_benefit: float | None = None  # last conclusive b (kept across inconclusive probes)
    decided_at: float | None = None
    next_probe_at: float | None = None  # None in NEW: due at once
    recent: list[float] = field(default_factory=list)
    recent_hits: list[float] = field(default_factory=list)
    probes: int = 0
    aborts: int = 0
    inconclusive_probes: int = 0        # probes in a row that ended inconclusive (back-off)
    reason: str = "new job"
    obs: list[list[float]] = field(default_factory=list)   # passive: recent [miss fraction, seconds]
    obs_total: int = 0                                     # passive: pairs seen since the last estimate

    # -- queries
    @property
    def mode(self) -> CacheMode:
        return CacheMode.BYPASS if self.phase is Phase.PROBE_BYPASS else CacheMode.NORMAL

    @property
    def probing(self) -> bool:
        return self.phase in (Phase.PROBE_BYPASS, Phase.MEASURE_NORMAL)

    def due(self, now: float, cfg: ProbeConfig | None = None) -> bool:
        """Wants a probe now (the board decides whether it may start)."""
        if self.phase not in (Phase.NEW, Phase.DECIDED):
            return False
        if cfg is not None and cfg.passive:  # only when regression stays unsure for long ...
            if self.next_probe_at is not None and now < self.next_probe_at:
                return False  # backing off after an inconclusive or aborted probe
            # (a job with a conclusive b keeps it: a dataset cached whole shows no misses
            # to regress on, and probing it would only slow it down to confirm the b
            # that got it cached) ...
            return self.flat(cfg) or (self.obs_total >= cfg.passive_probe_after and self.known_benefit is None)
        return self.next_probe_at is None or now >= self.next_probe_at

    def flat(self, cfg: ProbeConfig) -> bool:
        """Passive: ... or it says "no gain" without having seen the batches that would
        show one (the board probes it only if no other job of its dataset is known to gain)."""
        return (cfg.passive and self.inconclusive and self.known_benefit is None and self.benefit is not None
                and self.benefit < cfg.passive_probe_below)

    def effective_benefit(self, prior_benefit: float = DEFAULT_PRIOR_BENEFIT) -> float | None:
        """Benefit for allocation: None if never measured. An inconclusive
        (lower-bound) measurement counts as at least the last conclusive one,
        or the prior if there is none: a probe run while the dataset had no
        space must not erase what an earlier probe with space established
        (otherwise allocation would flap: no space -> "unknown" -> space -> ...)."""
        if self.benefit is None:
            return None
        if not self.inconclusive:
            return self.benefit
        floor = self.known_benefit if self.known_benefit is not None else prior_benefit
        return max(self.benefit, floor)

    def gain(self, cfg: ProbeConfig) -> JobGain:
        return JobGain(self.job_id, self.n_gpus, self.effective_benefit(cfg.prior_benefit),
                       self.inconclusive and self.known_benefit is None)

    # -- transitions
    def _go(self, new: Phase, now: float, reason: str) -> Transition:
        old = self.phase
        self.phase, self.phase_since, self.reason = new, now, reason
        self.samples, self.hits = [], []
        self.skip = 0
        return Transition(self.job_id, old, new, self.mode, reason, now)

    def start_probe(self, now: float, cfg: ProbeConfig, reason: str = "probe") -> Transition:
        t = self._go(Phase.PROBE_BYPASS, now, reason)
        self.skip = cfg.warmup_batches
        self.probe_t_miss = None
        self.recent, self.recent_hits = [], []
        self.obs_total = 0
        return t

    def _phase_done(self, cfg: ProbeConfig) -> bool:
        n = len(self.samples)
        if n >= cfg.max_batches:
            return True
        return n >= cfg.min_batches and relative_stderr(self.samples) <= cfg.rel_precision

    def _finish_phase(self, now: float, cfg: ProbeConfig, why: str) -> Transition:
        value = robust_mean(self.samples, cfg.trim)
        if self.phase is Phase.PROBE_BYPASS:
            self.probe_t_miss = value
            t = self._go(Phase.MEASURE_NORMAL, now, f"t_miss={value:.4g}s ({why})")
            self.skip = cfg.warmup_batches
            return t
        # MEASURE_NORMAL -> DECIDED
        assert self.probe_t_miss is not None
        h = _median(self.hits) if self.hits else None
        b = job_benefit(self.probe_t_miss, value)
        self.t_miss, self.t_hit, self.hit_ratio, self.benefit = self.probe_t_miss, value, h, b
        self.inconclusive = _lower_bound_only(self.probe_t_miss, value, h, cfg)
        if not self.inconclusive:
            self.known_benefit = b
        self.decided_at = now
        self.probes += 1
        self.inconclusive_probes = self.inconclusive_probes + 1 if self.inconclusive else 0
        if self.inconclusive:
            self.next_probe_at = now + inconclusive_backoff(cfg, self.inconclusive_probes)
        else:
            self.next_probe_at = now + cfg.reprobe_interval_s * (1 + cfg.reprobe_jitter * _jitter_frac(self.job_id))
        note = f", inconclusive (lower bound): hit ratio {h:.2f}" if self.inconclusive else ""
        return self._go(Phase.DECIDED, now, f"b={b:.3f} t_hit={value:.4g}s ({why}){note}")

    def _abort(self, now: float, cfg: ProbeConfig, why: str) -> Transition:
        self.aborts += 1
        self.next_probe_at = now + cfg.retry_after_abort_s
        back = Phase.DECIDED if self.benefit is not None else Phase.NEW
        return self._go(back, now, f"probe aborted: {why}")

    def report(self, batches: Iterable[Batch], now: float, cfg: ProbeConfig) -> list[Transition]:
        """Feed reported batches (any order); returns the transitions they caused."""
        out: list[Transition] = []
        for bt in sorted(batches, key=lambda x: x.end):
            if not 0 < bt.duration <= MAX_BATCH_S:
                continue  # a broken report must not poison the statistics
            if self.phase_since is not None and bt.end - bt.duration < self.phase_since:
                continue  # started under the previous mode
            if self.probing:
                if self.skip > 0:
                    self.skip -= 1
                    continue
                self.samples.append(bt.duration)
                if bt.hit_ratio is not None and self.phase is Phase.MEASURE_NORMAL:
                    self.hits.append(bt.hit_ratio)
                if self._phase_done(cfg):
                    why = "max batches" if len(self.samples) >= cfg.max_batches else "precise"
                    out.append(self._finish_phase(now, cfg, why))
            elif cfg.passive:
                t = self._observe(bt, now, cfg)
                if t:
                    out.append(t)
            elif self.phase is Phase.DECIDED:
                t = self._watch_drift(bt, now, cfg)
                if t:
                    out.append(t)
        return out

    def _observe(self, bt: Batch, now: float, cfg: ProbeConfig) -> Transition | None:
        """Passive mode: keep (miss fraction, time) pairs; re-estimate b now and then."""
        if bt.hit_ratio is None:
            return None
        self.obs.append([1.0 - bt.hit_ratio, bt.duration])
        del self.obs[:-cfg.passive_window]
        self.obs_total += 1
        first = self.benefit is None  # no estimate yet: try early and often
        every = cfg.passive_first_every if first else cfg.passive_every
        if self.obs_total % every or (first and self.obs_total < cfg.passive_first_n):
            return None
        est = regress_benefit([(m, t) for m, t in self.obs], min_n=cfg.passive_first_n if first else 30)
        if est is None:
            return None
        # A line read at m = 1 is only known where batches near m = 1 were seen: a job
        # that ran at its compute speed at every miss fraction it met may still be
        # I/O-bound when it misses all (its loader's prefetch hid the misses it had).
        high = sum(1 for m, _ in self.obs if m >= cfg.passive_high_miss) / len(self.obs)
        seen = high >= cfg.passive_high_share
        self.t_miss, self.t_hit, self.benefit, self.inconclusive = est.t_miss, est.t_hit, est.benefit, not seen
        self.hit_ratio = 1.0 - sum(m for m, _ in self.obs) / len(self.obs)
        self.decided_at, self.obs_total = now, 0
        if seen:
            self.known_benefit = est.benefit
            self.inconclusive_probes = 0
        note = "" if seen else f", a lower bound: {high:.0%} of batches missed >= {cfg.passive_high_miss:.0%}"
        since = self.phase_since
        t = self._go(Phase.DECIDED, now, f"b={est.benefit:.3f} from {est.n} batches (regression, "
                                         f"miss spread {est.spread:.2f}, t_miss +-{est.rel_stderr:.0%}{note})")
        # No mode switch (normal before and after): the batches after this one in the report,
        # and those in flight, were measured as they are. Dropping them as "started before the
        # switch" kept 25 pairs a report however many it carried.
        self.phase_since = since
        return t

    def _watch_drift(self, bt: Batch, now: float, cfg: ProbeConfig) -> Transition | None:
        self.recent.append(bt.duration)
        if bt.hit_ratio is not None:
            self.recent_hits.append(bt.hit_ratio)
        del self.recent[:-cfg.drift_window]
        del self.recent_hits[:-cfg.drift_window]
        if len(self.recent) < cfg.drift_window or (self.next_probe_at is not None and self.next_probe_at <= now):
            return None
        why = None
        m = robust_mean(self.recent, cfg.trim)
        if self.t_hit and abs(m / self.t_hit - 1) > cfg.drift_threshold:
            why = f"drift: normal time {self.t_hit:.4g}s -> {m:.4g}s"
        elif (self.inconclusive and len(self.recent_hits) >= cfg.drift_window
              and _median(self.recent_hits) >= cfg.min_hit_ratio):
            why = f"hit ratio now {_median(self.recent_hits):.2f}: re-measure"
        if why is None:
            return None
        self.next_probe_at = now
        self.recent, self.recent_hits = [], []
        self.reason = why
        return Transition(self.job_id, self.phase, self.phase, self.mode, why, now)

    def tick(self, now: float, cfg: ProbeConfig) -> list[Transition]:
        """Phase time-outs."""
        if not self.probing or self.phase_since is None or now - self.phase_since < cfg.max_phase_s:
            return []
        if len(self.samples) >= cfg.min_batches:
            return [self._finish_phase(now, cfg, "phase time limit")]
        return [self._abort(now, cfg, f"{len(self.samples)} steady batches in {cfg.max_phase_s:.0f}s")]

    def invalidate(self, now: float, cfg: ProbeConfig, reason: str) -> list[Transition]:
        """Conditions changed (job mix, store load): measure again."""
        if self.probing:
            return [self.start_probe(now, cfg, f"restart: {reason}")]
        if self.phase is Phase.DECIDED:
            self.next_probe_at = now
            self.reason = reason
        return []

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        # By hand, not asdict(): its deep copy of every sample made this the larger part
        # of the state's fingerprint, taken twice per decision round (StateStore.submit).
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("samples", "hits", "recent", "recent_hits"):
            d[k] = list(d[k])
        d["obs"] = [list(x) for x in self.obs]
        d["phase"] = self.phase.value
        if not d["inconclusive_probes"]:  # written only when set: a state the previous version can read
            del d["inconclusive_probes"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobProbe":
        d = dict(d)
        d["phase"] = Phase(d["phase"])
        for k in ("samples", "hits", "recent", "recent_hits"):
            d[k] = [float(x) for x in d.get(k, [])]
        d["obs"] = [[float(m), float(t)] for m, t in d.get("obs", [])]
        return cls(**d)


# ---------------------------------------------------------------- all jobs

@dataclass
class ProbeBoard:
    """All jobs' probes; limits concurrent probes per dataset (several jobs of a
    multi-job bypassing at once would load the store more than any one of them
    alone, inflating t_miss, and would stop their co-operative misses)."""

    config: ProbeConfig = field(default_factory=ProbeConfig)
    jobs: dict[str, JobProbe] = field(default_factory=dict)

    def add_job(self, job_id: str, dataset: str, n_gpus: int, now: float) -> list[Transition]:
        if n_gpus < 1:
            raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
        if job_id not in self.jobs:
            self.jobs[job_id] = JobProbe(job_id, dataset, n_gpus)
        return self._schedule(now)

    def remove_job(self, job_id: str, now: float) -> list[Transition]:
        self.jobs.pop(job_id, None)
        return self._schedule(now)  # a freed probe slot may start another

    def report(self, job_id: str, batches: Iterable[Batch], now: float) -> list[Transition]:
        job = self.jobs.get(job_id)
        if job is None:
            return []  # unknown or removed job: late reports are dropped
        return job.report(batches, now, self.config) + self._schedule(now)

    def tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        for jid in sorted(self.jobs):
            out += self.jobs[jid].tick(now, self.config)
        return out + self._schedule(now)

    def invalidate(self, now: float, reason: str, dataset: str | None = None) -> list[Transition]:
        """Re-probe all jobs (or those of ``dataset``)."""
        out: list[Transition] = []
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            if dataset is None or j.dataset == dataset:
                out += j.invalidate(now, self.config, reason)
        return out + self._schedule(now)

    def _schedule(self, now: float) -> list[Transition]:
        busy: dict[str, int] = {}
        for j in self.jobs.values():
            if j.probing:
                busy[j.dataset] = busy.get(j.dataset, 0) + 1
        # a dataset one of whose jobs is known to gain stays cached whatever its flat
        # jobs' probes would say: they need none
        gaining = {j.dataset for j in self.jobs.values() if (j.known_benefit or 0.0) >= self.config.passive_probe_below}
        due = [j for j in self.jobs.values() if j.due(now, self.config)
               and not (j.dataset in gaining and j.flat(self.config) and j.obs_total < self.config.passive_probe_after)]
        # oldest due first; never-measured jobs first among equals; then by id
        due.sort(key=lambda j: (j.next_probe_at if j.next_probe_at is not None else -math.inf,
                                j.benefit is not None, j.job_id))
        out = []
        for j in due:
            if busy.get(j.dataset, 0) < self.config.max_concurrent_per_dataset:
                busy[j.dataset] = busy.get(j.dataset, 0) + 1
                out.append(j.start_probe(now, self.config, "first probe" if j.benefit is None else "re-probe"))
        return out

    # -- outputs
    def modes(self) -> dict[str, CacheMode]:
        return {jid: j.mode for jid, j in sorted(self.jobs.items())}

    def job_gains(self) -> dict[str, list[JobGain]]:
        """Per dataset, its jobs' gains (input to allocation.allocate)."""
        out: dict[str, list[JobGain]] = {}
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            out.setdefault(j.dataset, []).append(j.gain(self.config))
        return out

    def dataset_gains(self) -> dict[str, float]:
        return {ds: dataset_gain(js, self.config.prior_benefit) for ds, js in self.job_gains().items()}

    def to_dict(self) -> dict[str, Any]:
        return {"config": _config_dict(self.config),
                "jobs": {jid: j.to_dict() for jid, j in sorted(self.jobs.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProbeBoard":
        return cls(ProbeConfig(**d.get("config", {})),
                   {jid: JobProbe.from_dict(j) for jid, j in d.get("jobs", {}).items()})


@lru_cache(maxsize=8)
def _frozen_config_dict(cfg: ProbeConfig) -> dict[str, Any]:
    return asdict(cfg)


def _config_dict(cfg: ProbeConfig) -> dict[str, Any]:
    """asdict(cfg), built once per config (frozen, flat): the state's fingerprint takes it
    twice per decision round."""
    return dict(_frozen_config_dict(cfg))
