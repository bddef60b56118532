"""The DataLoader that `CachedDataset.loader()` returns.

A standard torch DataLoader (so it drops into any training loop) whose batch
sampler is the substitutable-hit sampler, plus per-epoch statistics gathered
from the sampler (main process) and the workers (shared counters). Batch time
is the time between batches handed to the training loop: with and without the
cache it is what probing compares (manager). The sampler's set-up and the
epoch's measurement are shared with the tf.data front end (epochs.py).

With a transform on the dataset, the DataLoader itself runs no workers: its
batches come from preprocess.Scheduler, which consumes the same batch sampler
and runs the pipeline per sample in its own worker processes; batches are
regrouped as items finish, so the sampler is told which items each delivered
batch held."""
from __future__ import annotations

import atexit
import pickle
import weakref
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from cacheserver.malloc import keep_freed_memory

from .handoff import Handoff, make_handoff
from .epochs import EpochLog, EpochRun, make_sampler
from .sampler import SubstitutableBatchSampler
from .stats import LoaderCounters, counting_for, serve_loader

# DataLoader arguments the batch sampler replaces, and what to use instead.
_OURS = {
    "shuffle": "the loader shuffles every epoch itself (seed= fixes the order; substitute=False "
               "gives a plain seeded permutation)",
    "sampler": "the loader picks each batch's items itself (cached items first); for "
               "DistributedSampler pass rank= and world_size= (or initialise torch.distributed), "
               "for a fixed order substitute=False with seed=",
    "batch_sampler": "the loader's batch sampler is its own (SubstitutableBatchSampler); "
                     "pass batch_size=, drop_last=, seed=, rank=, world_size=",
    "in_order": "batches are delivered in order, which state_dict() relies on",
}
_HARMLESS = {"shuffle": False, "in_order": True}  # values that change nothing


class CachedLoader(DataLoader, EpochLog):
    def __init__(self, dataset, batch_sampler: SubstitutableBatchSampler, **kwargs) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        EpochLog.__init__(self)  # epoch_stats, batch_times, callbacks
        self.preprocess: Any = None  # a preprocess.Scheduler when the dataset has a transform
        self.autocache: Any = None  # a clients.autocache.Autocache with autocache= other than "source"
        self.remote: Any = None  # a preprocess.remote.RemoteWorkers with remote=
        self.handoff: Handoff | None = None  # how workers hand batches of bytes over (handoff.py)
        # persistent workers shut down by close() (or an error) so far: torch's iterator then just
        # ends, and an epoch that read from them ended early as if whole (items lost, epoch over)
        self._stops = 0

    def __iter__(self) -> Iterator:
        # A dataset closed in this process: DatasetClosed, not an epoch its persistent workers
        # (which cannot know) would read in full, nor a raw gRPC error from a manager call
        self.dataset.check_open()
        if self.autocache is not None:
            self.autocache.start_epoch(self.preprocess)
            if self.remote is not None:  # AutoOrder may have rekeyed the kept items
                ac = self.autocache
                self.remote.refresh(self.dataset, self.preprocess.pipeline, self.preprocess.job_seed,
                                    key=ac.key, prefix=ac.cut, key_seed=ac.seed)
        run = EpochRun(self.dataset, self.batch_sampler, self)
        complete = False
        try:
            for batch, indices in self._batches():
                self.dataset.check_open()  # closed mid-epoch: batches its workers read after close()
                run.batch(indices)
                yield batch
            complete = True
        finally:  # an epoch stopped early keeps its statistics too (complete=False)
            run.finish(complete, self.preprocess.last_stats if self.preprocess is not None else None,
                       self.autocache)

    def _batches(self) -> Iterator[tuple[Any, list[int] | None]]:
        """(batch, its item indices when regrouped by the preprocess scheduler, else None)."""
        if self.preprocess is None:
            yield from self._worker_batches()
            return
        sampler = self.batch_sampler
        epoch = sampler.epoch
        # Under DDP every rank must yield as many batches, else the others wait for ever in a
        # collective (all_reduce); items a rank leaves out (on_error="skip", exactly_once=False)
        # would make it fewer: counted before the walk starts (it takes a resumed state)
        due = len(sampler) if sampler.share.world > 1 else None
        # with remote workers, the feeder takes the sampler's batches ahead and hands them on
        # once their kept items are made: the workers below then read them as hits
        source = sampler if self.remote is None else self.remote.batches(sampler, epoch)
        made = 0
        for indices, items in self.preprocess.epoch(source, epoch, sampler.batch_size):
            if not indices:  # every item of the batch was skipped (in process): nothing to hand over
                continue
            if due is not None and made == due:  # a resumed rank's: the others have no more
                break
            made += 1
            yield self.collate_fn(items), indices
            if self.autocache is not None:  # auto decides once enough of the first epoch is measured
                self.autocache.after_batch(self.preprocess, sampler.share.size, sampler.batch_size)
        if self.autocache is not None:  # an epoch too short to measure (drop_last) decides at its end
            self.autocache.epoch_ended(self.preprocess, sampler.share.size, sampler.batch_size, sampler.drop_last)
        if due is not None and made < due:
            yield from self._pad(due - made, epoch)

    def _worker_batches(self) -> Iterator[tuple[Any, None]]:
        """The DataLoader's own batches. An exception raised out of torch's iterator (a Ctrl-C
        caught by a notebook, a worker's error) may leave its persistent workers mid-reset:
        the next epoch read the reset's stray acknowledgements as batches (KeyError:
        _ResumeIteration), or found workers a terminal's Ctrl-C had ended. Such an iterator
        is shut down, and the next epoch starts workers afresh."""
        if self.handoff is not None:
            self.handoff.new_generation()
        # without workers this process reads each batch: counted for this loader (stats.py)
        mine = self.counters if self.num_workers == 0 else None
        stops = self._stops
        try:
            with counting_for(mine):
                batches = super().__iter__()  # persistent workers: torch's reset reads the last epoch's messages
            if self.handoff is not None:  # so a slot still filled before lost its message (handoff.py)
                self.handoff.free_stale()
            while True:
                with counting_for(mine):  # not across the yield: the loop may read another loader meanwhile
                    batch = next(batches, _END)
                if batch is _END:
                    if self._stops != stops:  # close() stopped the workers: not the epoch's end
                        raise RuntimeError(self._closed_mid_epoch())
                    break
                yield batch, None
        except GeneratorExit:  # the loop left the epoch early: torch's reset copes
            raise
        except BaseException:
            self._stop_workers()
            raise

    def _stop_workers(self) -> None:
        """Shut down the persistent DataLoader workers, if any run; the next epoch starts new ones."""
        it, self._iterator = getattr(self, "_iterator", None), None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            self._stops += 1  # an epoch reading from them ends with an error, not as if whole
            shutdown()

    def _closed_mid_epoch(self) -> str:
        s = self.batch_sampler
        return (f"the loader was closed (loader.close()) during epoch {s.epoch - 1}, which its workers stopped "
                f"reading: {s.stats.delivered_items} of its items were handed over, the rest never read (the epoch "
                f"is not over: its state_dict() resumes them); iterate the loader again for an epoch with new workers")

    def _pad(self, short: int, epoch: int) -> Iterator[tuple[Any, list[int]]]:
        """`short` full batches more, for a rank that made fewer than the others: as
        DistributedSampler pads a share, they repeat items of the rank's share, from its
        start, run through the transform again (an item that fails again is skipped)."""
        engine, B = self.preprocess, self.batch_sampler.batch_size
        share = list(dict.fromkeys(self.batch_sampler.share.items(epoch) or []))
        want, pos, out = short * B, 0, []
        kept = engine.last_stats, engine.last_run, engine.drop_last
        engine.drop_last = False  # every output counts: the batches are cut here
        try:
            while len(out) < want and pos < len(share):
                chunk = share[pos:pos + want - len(out)]  # distinct items: the workers key items by index
                pos += len(chunk)
                for indices, items in engine.epoch([chunk], epoch, B):
                    out += zip(indices, items)
        finally:  # the epoch's statistics and items are the epoch's, not the padding's
            engine.last_stats, engine.last_run, engine.drop_last = kept
        if not out:
            share_ = self.batch_sampler.share
            raise RuntimeError(f"rank {share_.rank} of {share_.world}: the transform failed on every item of its "
                               f"share of epoch {epoch} (on_error='skip'), so it cannot yield the {short} more "
                               f"batches the other ranks do, and they would wait for it for ever in a collective; "
                               f"first errors: {(kept[0].errors if kept[0] else [])[:3]}")
        while len(out) < want:  # fewer good items than the padding: repeated
            out += out[:want - len(out)]
        for k in range(0, want, B):
            part = out[k:k + B]
            yield self.collate_fn([x for _, x in part]), [i for i, _ in part]

    def close(self) -> None:
        """Stop the loader's workers: the preprocessing ones, and the DataLoader's persistent
        ones, which would otherwise run on until the loader is collected, holding their reads'
        resources (the host's coalescing directory in /dev/shm outlived the process)."""
        self._stop_workers()
        if self.preprocess is not None:
            self.preprocess.close()
        if self.autocache is not None:
            self.autocache.close()
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def state_dict(self) -> dict[str, Any]:
        """Where training is, for a checkpoint (torchdata StatefulDataLoader's convention):
        the epoch in progress and the items of the batches already handed over."""
        return {"sampler": self.batch_sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the saved epoch's items not yet
        handed over; later iterations are the following epochs. ValueError if the state
        belongs to another dataset, split (rank, world size, drop_last) or seed."""
        if not isinstance(state, dict) or "sampler" not in state:  # not a bare KeyError: 'sampler'
            what = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"load_state_dict() takes what this loader's state_dict() returned (a dict with "
                             f"'sampler'), got {what}")
        self.batch_sampler.load_state_dict(state["sampler"])


# Loader arguments for preprocess.Scheduler (docs/preprocess.md).
PREPROCESS_OPTIONS = ("auto_order", "on_error", "cost_dir", "task_items", "exactly_once", "step_warning",
                      "step_timeout")


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """DataLoader arguments that our batch sampler replaces: refused, naming ours. Their
    DataLoader defaults (None, shuffle=False, in_order=True) ask for nothing: accepted."""
    for name, instead in _OURS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value is not None and value is not _HARMLESS.get(name):
            raise ValueError(f"CachedDataset.loader() does not take {name}=: {instead}")


# DataLoader options of its worker processes: with a transform= the per-sample scheduler runs
# the workers (preprocess/) and the DataLoader none, so torch would ignore them (timeout) or
# refuse them with num_workers=0 in its own words (persistent_workers, prefetch_factor).
_DATALOADER_WORKER_OPTIONS = {"timeout": 0, "worker_init_fn": None, "prefetch_factor": None,
                              "persistent_workers": False, "multiprocessing_context": None}


def check_worker_options(kwargs: dict[str, Any]) -> None:
    """With the per-sample scheduler, DataLoader worker options given: refused, naming them."""
    given = sorted(k for k, default in _DATALOADER_WORKER_OPTIONS.items()
                   if k in kwargs and kwargs[k] != default)
    if given:
        hint = " (a step stuck on an item: step_warning=, step_timeout=)" if "timeout" in given else ""
        raise ValueError(f"{', '.join(given)}: options of DataLoader worker processes, which do not run with a "
                         f"transform= (the per-sample scheduler runs its own workers, num_workers= of them: "
                         f"docs/preprocess.md); remove them{hint}, or pass scheduler='torch'")


def check_picklable(ds, kwargs: dict[str, Any]) -> None:
    """Workers are spawned: what they run travels pickled. Say which callable fails, and
    why, before any worker starts (not a bare PicklingError from inside torch)."""
    parts = {"decode": ds.decode, "target": getattr(ds, "target", None),
             "collate_fn": kwargs.get("collate_fn"), "worker_init_fn": kwargs.get("worker_init_fn")}
    for name, fn in parts.items():
        if fn is None or isinstance(fn, str):
            continue
        try:
            pickle.dumps(fn)
        except Exception as e:
            what = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"{name}={what} cannot be sent to DataLoader worker processes ({type(e).__name__}: {e}). "
                "Workers are spawned, so what they run must pickle: define it with def at the top level "
                "of a module (not a lambda, nor a function nested in another), or use num_workers=0"
            ) from None


def distributed_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): as given, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(f"pass rank= and world_size= together (got rank={rank}, world_size={world_size})")
    return rank, world_size


def make_loader(ds, batch_size: int, *, num_workers: int | None = 0, seed: int = 0, lookahead: int = 10,
                substitute: bool = True, miss_seed: int | None = None, drop_last: bool = False,
                rank: int | None = None, world_size: int | None = None, scheduler: str = "sample",
                autocache: str = "source", epochs: int | None = None, remote: str | None = None,
                remote_options: dict[str, Any] | None = None, **kwargs) -> CachedLoader:
    check_kwargs(kwargs)
    if remote is not None:
        autocache = _remote_mode(ds, scheduler, autocache, remote)
    if scheduler not in ("sample", "torch"):
        raise ValueError(f"scheduler must be 'sample' (per sample, preprocess/) or 'torch', got {scheduler!r}")
    options = {k: kwargs.pop(k) for k in PREPROCESS_OPTIONS if k in kwargs}
    if options and (ds.transform is None or scheduler == "torch"):
        raise ValueError(f"{', '.join(options)}: options of the per-sample scheduler, which runs only with "
                         f"a transform= (docs/preprocess.md)")
    per_sample = ds.transform is not None and scheduler == "sample"
    if autocache != "source" and not per_sample:
        raise ValueError(f"autocache={autocache!r}: caching modes other than 'source' need a transform= run by "
                         f"the per-sample scheduler (docs/preprocess.md, Autocache)")
    if per_sample:
        check_worker_options(kwargs)
    if per_sample or (num_workers or 0) > 0:
        check_picklable(ds, kwargs)
    rank, world_size = distributed_rank(rank, world_size)
    sampler = make_sampler(ds, batch_size, seed=seed, lookahead=lookahead, substitute=substitute,
                           miss_seed=miss_seed, drop_last=drop_last, rank=rank, world_size=world_size)
    engine = ac = None
    if per_sample:
        engine, ac = _scheduler(ds, num_workers, seed, drop_last, autocache, epochs, options)
        if ac is not None and substitute:  # the look-ahead finds what this mode reads as hits
            sampler.lookup = ac.lookup_codes
        num_workers = 0
    num_workers = num_workers or 0
    if num_workers > 0:
        # Workers are spawned, not forked: the main process runs gRPC and maybe the
        # embedded server's threads, which must not be forked mid-flight.
        kwargs.setdefault("multiprocessing_context", "spawn")
        kwargs.setdefault("persistent_workers", True)
    handoff = _handoff(ds, batch_size, num_workers, kwargs)
    kwargs.setdefault("collate_fn", handoff or _as_list)
    counters = LoaderCounters(ds.counters)
    if num_workers > 0:  # the workers' reads count for this loader too
        kwargs["worker_init_fn"] = _ServeLoader(counters, kwargs.get("worker_init_fn"))
    loader = CachedLoader(ds, sampler, num_workers=num_workers, **kwargs)
    loader.counters = counters
    if num_workers > 0:
        _stop_at_exit(loader)
    loader.preprocess, loader.autocache, loader.handoff = engine, ac, handoff
    if remote is not None:
        loader.remote = _remote(ds, engine, ac, remote, remote_options or {})
    loader.attach_coordinator(ds, sampler)
    return loader


_END = object()  # a DataLoader iterator's end


class _ServeLoader:
    """A DataLoader worker's start: its reads count for its loader (stats.py), then the
    user's worker_init_fn. Top-level: workers are spawned, it travels pickled."""

    def __init__(self, counters: LoaderCounters, then: Any = None) -> None:
        self.counters, self.then = counters, then

    def __call__(self, worker_id: int) -> None:
        serve_loader(self.counters)
        if self.then is not None:
            self.then(worker_id)


class _StopWorkers:
    """An exit hook: the loader's DataLoader workers stopped, if it is still alive."""

    def __init__(self, loader: CachedLoader) -> None:
        self.loader = weakref.ref(loader)  # the hook must not keep the loader alive

    def __call__(self) -> None:
        loader = self.loader()
        if loader is not None:
            loader._stop_workers()


def _stop_at_exit(loader: CachedLoader) -> None:
    """At the interpreter's exit, stop the loader's workers before the weakref finalizers run
    (atexit runs the later registered first; weakref's was registered on import): unstopped,
    they still held the host's coalescing directory (/dev/shm) when the main process let go
    of it, and were then killed, so nobody removed it. torch's own shutdown at exit is a no-op."""
    hook = _StopWorkers(loader)
    atexit.register(hook)
    gone = weakref.finalize(loader, atexit.unregister, hook)  # a collected loader leaves no hook behind
    gone.atexit = False  # at exit the hook runs instead


def _handoff(ds, batch_size: int, num_workers: int, kwargs: dict[str, Any]) -> Handoff | None:
    """Shared slots through which the workers hand batches of bytes over, unless the
    caller collates batches itself (handoff.py), or workers are not persistent. Items are
    bytes only where nothing decodes or transforms them, adds a target or groups them into samples."""
    if num_workers <= 0 or kwargs.get("collate_fn") is not None:
        return None
    if ds.decode is not None or ds.target is not None or ds.samples is not None or ds.transform is not None:
        return None
    if not kwargs.get("persistent_workers"):  # workers stopped mid-epoch would leave their slots filled
        return None
    handoff = make_handoff(ds.digest.sizes, batch_size, num_workers, kwargs.get("prefetch_factor"))
    if handoff is not None and ds.keep_freed_memory:  # the items copied out reuse the heap (cacheserver/malloc.py)
        keep_freed_memory()
    return handoff


def _remote_mode(ds, scheduler: str, autocache: str, remote: str) -> str:
    """remote= rides on the transformed mode: workers elsewhere make the kept items, the
    loader's own workers read them as hits and make only what is missing."""
    if ds.transform is None or scheduler != "sample":
        raise ValueError("remote=: remote workers run the transform's kept steps; pass transform= and the "
                         "per-sample scheduler (docs/preprocess.md, Remote workers)")
    from preprocess.remote.cluster import check_remote

    check_remote(remote)  # a malformed address fails before any worker starts
    if autocache not in ("source", "transformed"):
        raise ValueError(f"remote= reads what remote workers make as transformed hits: autocache='transformed' "
                         f"(the default with remote=), not {autocache!r}")
    return "transformed"


def _remote(ds, engine: Any, ac: Any, remote: str, options: dict[str, Any]) -> Any:
    """Remote workers keyed as the loader's transformed mode keys its kept items; None
    (one warning) when there is no cluster: the loader's own workers do everything."""
    from preprocess.remote import start

    # the loader's stuck-step limits hold for its remote workers too, unless remote_options say otherwise
    options = {"step_warning": engine.step_warning, "step_timeout": engine.step_timeout, **options}
    try:
        return start(ds, engine.pipeline, engine.job_seed, remote, key=ac.key, prefix=ac.cut, key_seed=ac.seed,
                     **options)
    except BaseException:
        engine.close()
        ac.close()
        raise


def _scheduler(ds, num_workers: int | None, seed: int, drop_last: bool, autocache: str, epochs: int | None,
               options: dict[str, Any]) -> tuple[Any, Any]:
    """The preprocess scheduler, prepared (profiled, workers started), and its autocache."""
    from preprocess.scheduler import Scheduler

    from .autocache import Autocache

    ac = Autocache(ds, autocache, epochs) if autocache != "source" else None
    engine = Scheduler(ds, ds.transform, num_workers=num_workers, job_seed=seed, drop_last=drop_last,
                       feed=ac.feed if ac is not None else None, **options)
    try:
        # profiles the pipeline; the workers start after autocache's probes of the read path, so
        # that their start-up does not slow what is measured
        engine.prepare(start_workers=False)
        if ac is not None:
            ac.prepare(engine)
        engine.start_workers()
    except BaseException:
        engine.close()
        raise
    return engine, ac


def _as_list(batch: list) -> list:
    """Items are bytes (or what `decode` returns): hand the batch over as a list."""
    return batch
