"""Autocache in the clients: which of compute, source or transformed a loader runs,
the cell its workers read the mode from, and the decision of "auto".

Modes (docs/preprocess.md, "Autocache"; the mechanism is clients/autofeed.py):
    compute      read the store, put nothing in the cache (the no-cache baseline)
    source       read through the cache, insert misses (the default: as without autocache)
    transformed  keep the sample's output at the caching point in the cache
    auto         decide among the three from measurements of the first epoch

A loader's autocache state (`state`), its transitions:
    fixed                         compute, source or transformed as asked, all run long
    measuring -> decided          auto: the read path is probed when the loader is made
                                  (before its workers start) and, with the profiled sample's
                                  step times, gives an estimate; the first epoch then runs
                                  in the mode the estimate favours (policy measuring_mode:
                                  transformed where it is clearly cheapest; else as source,
                                  also putting the outputs at the caching point as they are
                                  made where transformed is near the cheapest) until
                                  threshold() items are done; then choose() picks the mode
                                  for the rest of the run from the steps as the workers ran
                                  them
    measuring -> estimated        auto, as the loader is made: the estimate is clear (policy
                                  clear_estimate: its option cheaper than every other by 25%):
                                  choose() on the estimate at once, nothing measured; the
                                  first epoch runs in the chosen mode from its first item
    found                         auto: the transformed items of items spread over the
                                  dataset (outside the sample, which the probe puts) were in
                                  the cache already (another job ran this pipeline):
                                  transformed at once, nothing measured (Cachew §4.4 too);
                                  under a manager the probes are still reported, so that
                                  it counts this job on the set (its decision holds)
The caching point is the user's marker (preprocess.autocache / cache_at=) or the end of
the cacheable prefix. Nothing is kept when it is 0 (the first step is random), when
the key cannot be made (a step or decode that cannot be fingerprinted, a decode that
reads the entry, WebDataset samples: not functions of the content alone), or when the
sample's outputs there are not storable (preprocess/codec.py): `why_not` says which;
"auto" then chooses between compute and source."""
from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

from cacheserver.core import Limits
from cacheserver.vocab import HIT, transformed_tag
from manager.manager_client import ManagerError
from preprocess.codec import encode
from preprocess.fingerprint import Uncacheable, fingerprint, library_version, sub_fingerprint

from .autofeed import CacheFeed
from .coordination import SharedPlan

log = logging.getLogger("mlcache.autocache")

MODES = ("compute", "source", "transformed")
CHOICES = MODES + ("auto",)
_CODES = {m: k for k, m in enumerate(MODES)}
MAX_KEY = 128
EPOCHS_UNKNOWN = 100  # epochs_left when the loader was not told `epochs` (Cachew ignores the fill)
DECIDE_BATCHES = 300  # Cachew decides after 300 batches ...
DECIDE_SHARE = 0.1    # ... here at most a tenth of the first epoch (the read path is probed before it)
FOUND_SHARE = 0.9     # "found": this share of the items looked up has transformed items cached ...
FOUND_LOOKUP = 64     # ... of this many, spread over the dataset outside the profiled sample
MAX_IDS = Limits.max_batch_items  # ids one request may carry (clients/dataset.py MAX_IDS)


def choose(costs: Any, coordinator: Any = None, dataset: str = "", pipeline: str = "") -> Any:
    """The decision (manager.policy.autocache.Decision) for one (dataset, pipeline key)
    from its measured costs: the manager's where the job has one (it decides once per
    pipeline, with the room the budget leaves), else, or when it cannot be reached,
    this job's own by the same pure function. A pipeline with nothing to keep (no key)
    is decided here."""
    from manager.policy.autocache import decide

    if coordinator is not None and pipeline:
        d = coordinator.autocache_decision(dataset, pipeline, costs)
        if d is not None:
            return d
    return decide(costs)


class SharedMode:
    """The mode, caching point and key in shared memory: the loader publishes, its
    preprocessing workers read before each task."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        # version (0: being written), mode code, caching point, has seed, seed, no step after the
        # point, auto measuring (puts speculative; source mode puts the outputs too)
        self._a = ctx.RawArray("q", 7)
        self._key = ctx.RawArray("c", MAX_KEY)
        self._version = 0

    def publish(self, mode: str, cut: int = 0, key: str = "", seed: int | None = None,
                direct: bool = False, keep: bool = False) -> None:
        raw = key.encode()
        if len(raw) >= MAX_KEY:
            raise ValueError(f"autocache key of {len(raw)} bytes")
        self._version += 1
        self._a[0] = 0
        self._a[1], self._a[2], self._a[3], self._a[4] = _CODES[mode], cut, seed is not None, seed or 0
        self._a[5], self._a[6] = direct, keep
        self._key.value = raw
        self._a[0] = self._version

    def keep(self) -> bool:
        """Auto, measuring: the outputs at the caching point are put speculatively (as
        spare entries under a manager: their set is not allocated yet), in source mode too."""
        return bool(self._a[6])

    def direct(self) -> bool:
        """No step follows the caching point: a kept item is finished as it is read."""
        return bool(self._a[5])

    def read(self) -> tuple[str, int, str, int | None]:
        """(mode, caching point, key, seed of the kept items or None)."""
        return self.snapshot()[:4]

    def snapshot(self) -> tuple[str, int, str, int | None, bool]:
        """read() and keep() of one publication: a decision published between two reads
        cannot pair the old mode with the new keep."""
        for _ in range(10000):
            v = self._a[0]
            mode, cut, key = MODES[self._a[1]], self._a[2], self._key.value.decode()
            seed = self._a[4] if self._a[3] else None
            keep = bool(self._a[6])
            if v and self._a[0] == v:
                return mode, cut, key, seed, keep
            time.sleep(0.0001)
        raise RuntimeError("autocache: the shared mode stayed mid-update")


def transform_key(ds: Any, pipeline: Any, cut: int, seed: int | None = None) -> str:
    """What the transformed items of ds under the pipeline's first `cut` steps are keyed
    by (with each item's content key): those steps and the decode that makes their
    input, and where those steps draw random numbers the job's `seed`: jobs of other
    seeds make other items, so they are other sets for the manager (sized, shared and
    decided apart). Raises Uncacheable where the output is not a function of the content."""
    if ds.samples is not None:
        raise Uncacheable("WebDataset samples carry their key and shard URL: not a function of the content")
    if ds.decode is not None and ds._decode_entry:
        raise Uncacheable("decode takes the entry (path, target): its output is not a function of the content")
    dec = "" if ds.decode is None else fingerprint(ds.decode, path="decode")
    # seeded steps draw by their written position and from torch's generator too
    seeded = (tuple(pipeline.order[:cut]), library_version("torch"), seed) if pipeline.seeded(cut) else ()
    return sub_fingerprint(("mlcache-autocache/1", dec, pipeline.fingerprint(cut), seeded))


def storable(outputs: Sequence[Any]) -> str:
    """'' when the codec stores every output, else why not."""
    try:
        for x in outputs:
            encode(x)
    except Uncacheable as e:
        return f"the output at the caching point cannot be stored: {e}"
    return ""


class Autocache:
    """A loader's autocache: `mode`, `state`, `decision` (mode, costs, reason)."""

    def __init__(self, ds: Any, requested: str, epochs: int | None = None) -> None:
        if requested not in CHOICES:
            raise ValueError(f"autocache must be one of {CHOICES}, got {requested!r}")
        if requested in ("auto", "transformed") and ds.cache_spec is None:
            raise ValueError(f"autocache={requested!r} keeps items in the cache, but this dataset has none "
                             f"(cache=False)")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.ds, self.requested, self.epochs = ds, requested, epochs
        self.mode = "source" if requested == "auto" else requested
        self.state = "measuring" if requested == "auto" else "fixed"  # transitions: the module docstring
        self.decision: Any = None
        self.costs: Any = None  # the PipelineCosts measured (auto)
        self.probes: dict[str, float] | None = None  # the read path probed before the workers start (auto)
        self.estimate: Any = None  # the Decision on the probes and the sample, before the first epoch (auto)
        self.keep = True  # measuring: put the outputs at the caching point as they are made (speculatively)
        self.note = ""  # why a decision was taken on less than was to be measured (epoch_ended)
        self.cut, self.key, self.why_not = 0, "", ""
        self.seed: int | None = None  # the job's seed, where the steps kept draw random numbers
        self.direct = False  # no step after the caching point: hits need no worker
        self._order: tuple[int, ...] | None = None
        self._ids: list[bytes | None] = []  # transformed ids under _ids_key, for the look-ahead
        self._ids_key: tuple = ()
        self.shared = SharedMode()
        # the transformed set is a dataset of its own to the manager, with its own plan
        # (GetPlan(transformed_tag)); without a manager: insert everything, as chunk 0
        self.plan = SharedPlan()
        self.feed = CacheFeed(ds, self.shared, self.plan)
        self.shared.publish(self.mode)

    # ---- what the loader sees --------------------------------------------------
    @property
    def reason(self) -> str:
        if self.decision is not None:
            return self.decision.reason + (f" ({self.note})" if self.note else "")
        if self.state == "measuring":
            est = "" if self.estimate is None else f"; estimated {self.estimate.mode}"
            kept = ", outputs kept as made" if self.mode == "source" and self.keep and self.key else ""
            return f"measuring the first epoch (running as {self.mode}{kept}{est})"
        return f"fixed by the loader's autocache={self.requested!r}" + (
            f"; nothing can be kept: {self.why_not}" if self.why_not else "")

    def line(self) -> str:
        return f"{self.mode} ({self.state}): {self.reason}"

    # ---- before the first epoch, and at each ------------------------------------
    def prepare(self, engine: Any) -> None:
        """After the scheduler's prepare (profiled sample, final declared-random steps):
        the caching point, the key, and whether anything can be kept."""
        pipe = engine.pipeline
        self.cut = pipe.caching_point()  # ValueError: a marker after a random step
        self._rekey(engine)
        if self.requested == "transformed" and self.why_not:
            raise ValueError(f"autocache='transformed' cannot keep this pipeline's items: {self.why_not}")
        if self.requested == "auto" and not self.why_not:
            self._look_for_others(engine)
        if self.state == "measuring":
            self._estimate(engine)
        elif self.requested == "transformed":
            self._report_fixed(engine)
        self.refresh_plan()
        self._publish()

    def _rekey(self, engine: Any) -> None:
        pipe, ds = engine.pipeline, self.ds
        self._order = pipe.order
        self.key, self.why_not, self.seed = "", "", None
        self.direct = self.cut == len(pipe.order)
        if pipe.seeded(self.cut):
            self.seed = engine.job_seed
            if not -(1 << 63) <= self.seed < (1 << 63):
                self.why_not = f"the loader's seed {self.seed} does not fit in 64 bits"
                return
        if self.cut == 0:
            j = pipe.order[0]
            self.why_not = f"step {j} ({pipe.steps[j].name}) is random and runs first: nothing comes before it"
            return
        try:
            self.key = transform_key(ds, pipe, self.cut, self.seed)
        except Uncacheable as e:
            self.why_not = str(e)
            return
        if engine.sample is not None and engine.sample.order == pipe.order:
            self.why_not = storable(engine.sample.inputs[self.cut])
        if self.why_not:
            self.key = ""

    def _publish(self) -> None:
        # measuring, the outputs at the point are put as they are made: if transformed is
        # chosen, the measured part of the first epoch need not be made again in the second
        self.shared.publish(self.mode, self.cut, self.key, self.seed, self.direct,
                            keep=self.state == "measuring" and self.keep and bool(self.key))

    def start_epoch(self, engine: Any) -> None:
        """AutoOrder may have changed the order after the first epoch: a new caching point
        (a random step moved forward shortens the cacheable prefix) and key."""
        if engine.pipeline.order != self._order:
            old = self.key
            self.cut = engine.pipeline.caching_point()
            self._rekey(engine)
            if self.mode == "transformed" and not self.key:
                self.mode = "source"
            if self.mode == "transformed" and self.key != old:
                self._report_rekeyed()
            self._publish()
        self.refresh_plan()

    def _report_rekeyed(self) -> None:
        """Transformed under a new key, under a manager: the new pipeline reported (on the
        costs last reported: the sample was traced in the old order), else the manager knows
        no set under it: no plan, no allocation. Auto takes the manager's decision for it."""
        coord = self.ds.coordinator
        if coord is None or self.costs is None:
            return
        d = coord.autocache_decision(self.ds.dataset_tag, self.key, self.costs,
                                     fixed=self.requested == "transformed")
        if d is None:
            return
        if self.requested == "auto":
            self.decision, self.mode = d, d.mode
        elif d.mode != "transformed":
            log.warning("autocache: the manager would run the reordered pipeline as %s (%s); kept transformed "
                        "as asked", d.mode, d.reason)

    def _look_for_others(self, engine: Any) -> None:
        # not the sample's items: the probe puts their outputs whatever is decided, so a
        # run with the same seed (this job restarted, another loader) would find its own
        if self.found_others(set(engine.sample_indices or ())):
            self._report_found(engine)

    def found_others(self, skip: set[int] | frozenset[int] = frozenset()) -> bool:
        """Whether the transformed items of FOUND_LOOKUP items spread over the dataset (none
        in `skip`) are cached already, FOUND_SHARE of them (another job ran this pipeline):
        then this one runs transformed at once (state "found"), nothing measured."""
        n = len(self.ds)
        idx = [i for i in range(0, n, max(1, n // FOUND_LOOKUP)) if i not in skip][:FOUND_LOOKUP]
        if not idx:
            return False
        got = self.transformed().lookup([self.ds.digest.hashes[i].tobytes() for i in idx])
        if sum(got) < FOUND_SHARE * len(idx):
            return False
        from manager.policy.autocache import Decision

        self.mode, self.state = "transformed", "found"
        self.decision = Decision("transformed", {}, f"transformed: {sum(got)} of {len(idx)} items' transformed "
                                                    f"items were cached already (another job)")
        return True

    def _report_found(self, engine: Any) -> None:
        """Found, under a manager: report the pipeline all the same (on the probes and the
        sample). The manager counts a job on a transformed set only once it reported it (a
        job registered again under its name reads its source dataset until then), so the
        set this job reads would go idle and be dropped under it. The manager's decision
        for the pipeline holds; unreachable, the found one does."""
        coord = self.ds.coordinator
        if coord is None:
            return
        from .automeasure import estimate, probe

        self.probes = probe(self, engine)
        costs = estimate(self, engine, len(self.ds))
        d = coord.autocache_decision(self.ds.dataset_tag, self.key, costs)
        if d is not None:
            self.costs, self.decision = costs, d
            self.mode, self.state = d.mode, ("found" if d.mode == "transformed" else "estimated")

    def _report_fixed(self, engine: Any) -> None:
        """Fixed at transformed, under a manager: report the pipeline (on the probes and the
        sample) as auto does. The manager knows a transformed set only from a report: without
        one it had no plan (GetPlan refused every epoch), no allocation and none of the job's
        gain. The mode stays as asked, whatever the manager would have chosen."""
        coord = self.ds.coordinator
        if coord is None or not self.key:
            return
        from .automeasure import estimate, probe

        self.probes = probe(self, engine)
        self.costs = estimate(self, engine, len(self.ds))
        d = coord.autocache_decision(self.ds.dataset_tag, self.key, self.costs, fixed=True)
        if d is not None and d.mode != "transformed":
            log.warning("autocache: the manager would run this pipeline as %s (%s); kept transformed as asked "
                        "(the manager counts this job on its transformed set all the same)", d.mode, d.reason)

    def _estimate(self, engine: Any) -> None:
        """Probe the read path (the workers not started yet) and estimate: the mode the
        measured part of the first epoch runs in, and whether it keeps its outputs."""
        from manager.policy.autocache import clear_estimate, measuring_mode

        from .automeasure import estimate, probe

        self.probes = probe(self, engine)
        costs = estimate(self, engine, len(self.ds))
        self.mode, self.keep, self.estimate = measuring_mode(costs)
        if not self.key:
            self.mode, self.keep = "source", False
        log.info("autocache: estimated %s before the first epoch; %s", self.estimate.mode, self.estimate.reason)
        if clear_estimate(self.estimate):  # nothing measured: the first epoch runs as decided
            self._take(costs, "estimated")

    def transformed(self) -> Any:
        """This process's TransformedItems under the current key."""
        return self.feed.proc().transformed(self.ds, self.key, self.seed)

    # ---- during the first epoch ------------------------------------------------
    def threshold(self, epoch_items: int, batch_size: int) -> int:
        """Items measured before deciding: Cachew's 300 batches, at most a tenth of
        the epoch, at least one batch, but never more than the epoch (one shorter than
        a batch would otherwise stay measuring for ever)."""
        at_least = max(batch_size, min(DECIDE_BATCHES * batch_size, int(DECIDE_SHARE * epoch_items)))
        return max(1, min(epoch_items, at_least))

    def after_batch(self, engine: Any, epoch_items: int, batch_size: int) -> None:
        """Auto: once enough of the first epoch is measured, decide and switch."""
        if self.state != "measuring":
            return
        stats = engine.last_stats
        # items skipped or left out are past too: counting only those finished, an epoch
        # shorter than the threshold with one skipped would stay measuring for ever
        if stats is None or stats.items + stats.skipped + stats.dropped < self.threshold(epoch_items, batch_size):
            return
        from .automeasure import measure

        self.decide(measure(self, engine, epoch_items))

    def epoch_ended(self, engine: Any, epoch_items: int, batch_size: int, drop_last: bool = False) -> None:
        """Auto, an epoch run to its end still measuring (it measured fewer items than the
        threshold: with drop_last an epoch shorter than a batch yields none; a resumed epoch
        holds only its rest): decide now on what there is, the profiled sample's step times
        standing in for steps the epoch did not run, rather than measure for ever."""
        if self.state != "measuring":
            return
        from .automeasure import estimate, measure

        stats = engine.last_stats
        done = 0 if stats is None else stats.items
        if done == 0 and drop_last and epoch_items < batch_size:
            self.note = (f"the epoch made no full batch ({epoch_items} items, batch_size {batch_size}, "
                         f"drop_last): decided on the profiled sample")
        else:
            self.note = (f"the epoch ended with {done} items measured, fewer than the "
                         f"{self.threshold(epoch_items, batch_size)} wanted")
        self.decide(measure(self, engine, epoch_items) if stats is not None else estimate(self, engine, epoch_items))

    def epochs_left(self) -> int:
        return EPOCHS_UNKNOWN if self.epochs is None else max(0, self.epochs - 1)

    def decide(self, costs: Any) -> None:
        """Measuring -> decided: choose() on the measured costs, and switch."""
        self._take(costs, "decided")
        self.refresh_plan()
        self._publish()

    def _take(self, costs: Any, state: str) -> None:
        self.costs = costs
        self.decision = choose(costs, self.ds.coordinator, self.ds.dataset_tag, self.key)
        self.mode, self.state = self.decision.mode, state
        if self.mode == "transformed" and not self.key:  # a policy must not pick it; never trusted to
            self.mode = "source"

    def refresh_plan(self) -> None:
        """The manager's plan of the transformed set (before each epoch, after a decision);
        the last one holds while the manager cannot be reached."""
        coord = self.ds.coordinator
        if coord is None or self.mode != "transformed" or not self.key or self.state == "measuring":
            return  # measuring: the set is not allocated yet, puts are speculative (SharedMode.keep)
        try:
            self.plan.publish(coord.client.get_plan(transformed_tag(self.ds.dataset_tag, self.key), self.ds.job))
        except ManagerError as e:
            log.warning("autocache: the plan of the transformed items could not be had (%s); keeping the last", e)

    def set_point(self, key: str, why_not: str) -> None:
        """A front end that keys its transform itself (tf.data: the chain's fingerprint,
        the whole chain being the prefix)."""
        self.cut, self.key, self.why_not = 1, ("" if why_not else key), why_not
        if self.requested == "transformed" and why_not:
            raise ValueError(f"autocache='transformed' cannot keep this transform's items: {why_not}")
        self._publish()

    def lookup_codes(self, indices: Sequence[int]) -> list[int]:
        """The sampler's look-ahead in the current mode: in transformed mode an item is
        a hit when its transformed item is cached; in compute mode nothing is."""
        if self.mode == "source":
            return self.ds.lookup_codes(indices)
        if self.mode == "compute":
            return [0] * len(indices)
        if self._ids_key != (self.key, self.seed):  # ids derived once per item and key: the look-ahead repeats them
            self._ids, self._ids_key = [None] * len(self.ds.digest), (self.key, self.seed)
        t, ids, h = self.transformed(), self._ids, self.ds.digest.hashes
        for i in indices:
            if ids[i] is None:
                ids[i] = t.ids([h[i].tobytes()])[0]
        want = [ids[i] for i in indices]  # the look-ahead's window: more ids than a request may carry
        present = [p for k in range(0, len(want), MAX_IDS) for p in t.ring.lookup(want[k:k + MAX_IDS], t.job)]
        return [HIT if p else 0 for p in present]

    def close(self) -> None:
        self.feed.close()
