"""tf_dataset(..., transform=chain, autocache=...): autocache for the tf.data front end.
(map_fn=, num_workers=: clients/tf_transform.py.)

`transform` is a per-item chain, a function from a tf.data.Dataset of items to a
dataset with one element per item (`lambda ds: ds.map(parse).map(resize)`). Its key is
preprocess/tf_fingerprint.chain_fingerprint; the whole chain is the prefix (the
caching point is its end). With autocache="source" (the default) the chain is simply
applied to the dataset in TensorFlow. In the other modes the elements come from a
Python generator, one sampler batch at a time:

    transformed  the batch's transformed items are looked up; hits are decoded
                 (numpy, preprocess/codec.py); the misses' sources are read (from
                 the cache if it holds them, never inserted), the chain runs on them
                 in this process, and its outputs are put (asynchronously) and yielded;
                 with a manager the pipeline is reported after the first batch (its
                 outputs are spare entries until then: the set has no plan yet)
    compute      the store is read, the chain runs on every item, nothing is cached
    auto         first looks up the transformed items of items spread over the
                 dataset: where another job (or an earlier run) cached them, it runs
                 transformed at once ("found", as the PyTorch loader's Autocache;
                 under a manager the pipeline is reported after the first batch);
                 else runs as source (reads inserted) while timing the chain, then
                 decides (clients/autocache.choose) as the PyTorch loader does, at
                 the latest at the end of an epoch (a resumed one holds only its rest)

Every item still comes exactly once per epoch (the sampler's batches, in its
order); the element_spec is the chain's. The chain must keep one element per item
(no filter, batch, repeat): a ValueError says so otherwise. A chain that cannot be
keyed (tf.py_function, tf.Variables, lookup tables), that draws random numbers or that
may yield elements out of order (deterministic=False) is never cached:
autocache="transformed" refuses it, "auto" chooses between compute and source."""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from preprocess.tf_fingerprint import UnfingerprintableChain, chain_fingerprint, dummy_source

from .autocache import Autocache
from .autofeed import kept_items, reader, speculative_chunk
from .automeasure import costs, read_costs
from .epochs import EpochRun
from .stats import SharedCounters

if TYPE_CHECKING:
    import tensorflow as tf

log = logging.getLogger("mlcache.autocache")

SAMPLE = 16  # items of a batch whose reads auto (and a fixed transformed report) times


def chain_key(transform: Callable[[Any], Any]) -> tuple[str, str]:
    """(key, why not cacheable) of a tf.data chain."""
    try:
        ck = chain_fingerprint(transform)
    except UnfingerprintableChain as e:
        return "", str(e)
    if not ck.ordered:
        # outputs are matched to items by position: out of order they would be kept under other items' keys
        return "", ("the chain may yield its elements out of order (deterministic=False, a sloppy interleave "
                    "or Options.deterministic=False): its outputs cannot be matched to their items")
    if ck.random:
        return "", ("the chain draws random numbers (stateful random ops, shuffle): its outputs differ "
                    "per call")
    # hex, as the manager keys pipelines
    return hashlib.sha256(f"mlcache-tfchain/1/{ck.key}".encode()).hexdigest(), ""


class ChainRunner:
    """The chain on a batch of items, in this process (traced once)."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        import tensorflow as tf

        self.spec = transform(dummy_source()).element_spec
        self._fn = tf.function(lambda xs: transform(tf.data.Dataset.from_tensor_slices(xs)),
                               input_signature=[tf.TensorSpec([None], tf.string)])
        self.seconds, self.items = 0.0, 0

    def run(self, items: list[bytes]) -> list[Any]:
        if not items:
            return []
        t0 = time.perf_counter()
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        out = list(self._fn(arr).as_numpy_iterator())
        self.seconds += time.perf_counter() - t0
        self.items += len(items)
        if len(out) != len(items):
            raise ValueError(f"the transform made {len(out)} elements of {len(items)} items: autocache keeps "
                             f"one output per item, so the chain must map each item to one element "
                             f"(no filter, batch, unbatch or repeat; apply those after tf_dataset)")
        return out


class TransformedEpochs:
    """The generator behind tf_dataset's dataset in the modes other than source."""

    def __init__(self, source: Any, runner: ChainRunner, ac: Autocache) -> None:
        self.source, self.runner, self.ac = source, runner, ac
        # fixed at transformed (or auto, found cached) under a manager: the pipeline is reported
        # once, after the first batch (no probe runs before: the chain has not run yet); until
        # then the set has no plan
        self.unreported = ((ac.requested == "transformed" or ac.state == "found")
                           and source.cached.coordinator is not None)
        self._last: tuple[list[int], list[Any]] | None = None  # the last batch and its outputs (auto)

    def epoch(self) -> Iterator[Any]:
        src = self.source
        src.check_pass()  # a resumed epoch the dataset's declared cardinality cannot hold
        if not self.unreported:  # unreported, the manager knows no such set: GetPlan would be refused
            self.ac.refresh_plan()  # the manager's plan of the transformed set, before each epoch (as the loader)
        run = EpochRun(src.cached, src.sampler, src)
        complete = False
        try:
            for batch in src.sampler:
                out = self._batch(batch)
                run.batch()
                yield from out
                self._last = (batch, out)
                self._report_fixed(batch, out)
                self._maybe_decide(batch, out)
            self._epoch_ended()
            complete = True
        finally:
            self.ac.feed.idle()  # this epoch's puts are in before the next looks them up
            run.finish(complete, None, self.ac)

    def _batch(self, batch: list[int]) -> list[Any]:
        ac, cached = self.ac, self.source.cached
        st = ac.feed.proc()
        if ac.mode != "transformed":
            outs = self.runner.run((st.store if ac.mode == "compute" else cached).read(batch))
            if ac.state == "measuring" and ac.key:  # kept as made: a transformed decision reuses them
                t = st.transformed(cached, ac.key, ac.seed)
                for i, y in zip(batch, outs):
                    st.putter.add((t, cached.digest.hashes[i].tobytes(), speculative_chunk(cached), False), y)
            return outs
        t, Ks, got, bad = kept_items(st, cached, batch, ac.key, ac.seed)
        miss = [p for p, v in enumerate(got) if v is None]
        # measuring, the sources are inserted too: a source decision reads none of them again
        outs = self.runner.run((cached if ac.state == "measuring" else st.source).read([batch[p] for p in miss]))
        for p, y in zip(miss, outs):
            # the manager's plan of the transformed set; before the report it has none: spare
            # entries (as auto's before its decision), which the manager's reconcile leaves alone
            chunk = speculative_chunk(cached) if self.unreported else ac.plan.insert_chunk(batch[p])
            if chunk is not None:
                st.putter.add((t, Ks[p], chunk, p in bad), y)
            got[p] = y
        return got

    def _report_fixed(self, batch: list[int], out: list[Any]) -> None:
        """Fixed at transformed (or auto, found cached), under a manager: report the pipeline
        (as auto's decision does, as the PyTorch loader's Autocache._report_fixed and
        _report_found do), else the manager knows no transformed set: no plan (GetPlan refused
        every epoch), no allocation, none of the job's gain. Costs as at the start (done=0).
        Fixed, the mode stays as asked; found, the manager's decision for the pipeline holds."""
        if not self.unreported:
            return
        ac = self.ac
        if ac.ds.coordinator is None:  # closed under the paused epoch (close() takes the coordinator)
            ac.ds.check_open()
            return
        self.unreported = False
        try:
            costs = self._costs(batch, out, 0)
        except Exception as e:  # a report is for the manager's books: never fail the epoch for it
            log.warning("autocache: timing the chain's read path for the manager's report failed: %s", e)
            return
        fixed = ac.state != "found"
        # fixed: the manager counts the job on the transformed set whatever it decides
        d = ac.ds.coordinator.autocache_decision(ac.ds.dataset_tag, ac.key, costs, fixed=fixed)
        if fixed:
            ac.costs = costs
            if d is not None and d.mode != "transformed":
                log.warning("autocache: the manager would run this chain as %s (%s); kept transformed as asked "
                            "(the manager counts this job on its transformed set all the same)", d.mode, d.reason)
        elif d is not None:  # unreachable, the found decision holds
            ac.costs, ac.decision = costs, d
            ac.mode, ac.state = d.mode, ("found" if d.mode == "transformed" else "estimated")
        ac.refresh_plan()  # the rest of the epoch follows the set's plan

    def _maybe_decide(self, batch: list[int], out: list[Any]) -> None:
        ac, r, sampler = self.ac, self.runner, self.source.sampler
        if ac.state != "measuring" or r.items < ac.threshold(sampler.share.size, sampler.batch_size):
            return
        ac.decide(self._costs(batch, out, r.items))

    def _epoch_ended(self) -> None:
        """Auto, an epoch run to its end still measuring (a resumed epoch holds only its
        rest, fewer items than the threshold): decide now on what there is, as the PyTorch
        loader's Autocache.epoch_ended, rather than measure on into the next epochs."""
        ac, r, sampler = self.ac, self.runner, self.source.sampler
        if ac.state != "measuring":
            return
        ac.note = (f"the epoch ended with {r.items} items measured, fewer than the "
                   f"{ac.threshold(sampler.share.size, sampler.batch_size)} wanted")
        if self._last is not None:
            ac.decide(self._costs(*self._last, r.items))
            return
        idx = list(range(min(SAMPLE, len(self.source.cached))))  # no batch yet (an empty share)
        ac.decide(self._costs(idx, None, r.items))

    def _costs(self, batch: list[int], out: list[Any] | None, done: int) -> Any:
        """PipelineCosts: the read path timed on the batch's first SAMPLE items (`out`: their
        outputs; None: made here), the chain by its runs so far (or here, where it has not run:
        every item a hit)."""
        ac, r, sampler = self.ac, self.runner, self.source.sampler
        idx = batch[:SAMPLE]
        if out is None or not r.items:
            out = self._run_quietly(idx)
        kept = [(self.source.cached.digest.hashes[i].tobytes(), y) for i, y in zip(idx, out)] if ac.key else []
        # fill=False: these items were just read through the cache in this epoch (measuring runs as
        # source); any missing are ones it does not insert, and reading them again counted twice in its stats
        reads = read_costs(ac, idx, kept, fill=False)
        return costs(ac, reads, sampler.share.size, done, r.seconds / max(1, r.items), 0.0, 1)

    def _run_quietly(self, idx: list[int]) -> list[Any]:
        """The chain on idx's sources, read from the cache or the store without inserting
        them or counting in any epoch's statistics (the runner times it)."""
        v = reader(self.source.cached, cache=True)
        v.counters = SharedCounters()
        try:
            return self.runner.run(v.read(idx))
        finally:
            if v._state is not None:
                v._state.close()


def look_for_others(ac: Autocache) -> None:
    """Auto: where another job cached this chain's transformed items, run transformed at
    once (state "found"), as the PyTorch loader does. No profiled sample here to leave
    out: the chain has not run in this job yet."""
    if ac.requested == "auto" and ac.key:
        ac.found_others()


def transformed_dataset(source: Any, transform: Callable[[Any], Any], autocache: str,
                        epochs: int | None) -> "tf.data.Dataset":
    """The dataset of `transform`'s elements in an autocache mode other than source; its
    cardinality is `source.declared` (None: not declared, tf_source._declared)."""
    import tensorflow as tf

    ac = Autocache(source.cached, autocache, epochs)
    ac.set_point(*chain_key(transform))
    look_for_others(ac)
    runner = ChainRunner(transform)
    source.autocache = ac
    if source.sampler.lookup is not None:  # the look-ahead finds what this mode reads as hits
        source.sampler.lookup = ac.lookup_codes
    source.starter.start = TransformedEpochs(source, runner, ac).epoch  # let go of on close (tf_batches.Starter)
    ds = tf.data.Dataset.from_generator(source.starter, output_signature=runner.spec)
    if source.declared is None:
        return ds
    return ds.apply(tf.data.experimental.assert_cardinality(source.declared))
