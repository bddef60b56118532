"""A training job's side of the cache manager (manager/), in the main process.

- registers the job (dataset fingerprint, size, GPUs) and, when no cache
  addresses were given, takes the ring from the manager;
- reports mini-batch times in the background (probing compares them with and
  without the cache; the servers apply bypass mode themselves): every
  `report_seconds` while the plan has chunk work or the job runs in bypass, else
  every `quiet_report_seconds` -- with no chunk to load or release nothing waits
  on a report, and each one costs the manager a journaled event;
- keeps the chunk plan current and publishes it to DataLoader workers through
  shared memory (`SharedPlan`): which items may be inserted, under which chunk;
- releases a chunk once every loader of the job with an epoch in progress has consumed
  those of its items it reads this epoch (all of them; a DDP rank's share; what a resumed
  epoch has left): each loader's epoch stream counts its own reads (chunkreads.py), and
  reports how much of the loading chunk is cached (a sampled Lookup);
- prefetches missing items of the loading chunk at a capped rate (servers
  cannot read stores or decrypt, so loading is the clients' work).
Everything tolerates a manager that is down: the last plan holds, and a batch report whose
call failed is sent again under its number (the manager applies a number once: its reply may
have been lost after it applied the report). A step that outlives close()'s wait (a slow store
read or look-up) ends without another manager call; the training loop's own calls (a chunk
release, an autocache report) raise DatasetClosed after close().
"""
from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import grpc

from cacheserver.vocab import Option
from manager import jobtokens
from manager.manager_client import ManagerClient, ManagerError, ManagerUnavailable, Plan
from manager.policy.autocache import Decision, PipelineCosts

from .batchreports import QUEUED_MAX, REPORT_MAX, BatchReports, LoaderHits
from .chunkreads import ChunkReads
from .jobtokenfile import JobTokenFile
from .procstate import DatasetClosed
from .sharedplan import MAX_CHUNKS, SPARE, SharedPlan

# SharedPlan and its words live in sharedplan.py; still imported from here
__all__ = ["CoordinatedDataset", "JobCoordinator", "JobRefused", "MAX_CHUNKS", "SPARE", "SharedPlan"]

log = logging.getLogger("mlcache.client")
RELEASE_BACKOFF_S = 2.0  # after a failed chunk release, the first wait before the next try
MAX_RELEASE_BACKOFF_S = 60.0
# Items a prefetch reads between two checks of the stop: close() waits for the part in hand
# only (a slow store may take seconds an item), not for the whole prefetch. As many as the
# default fetch_threads, so a part still reads them all at once from a high-latency store.
PREFETCH_PART = 16
CLOSE_WAIT_S = 5.0  # close() waits at most this long for the thread


def _listing(plan: Plan) -> tuple[int, int, int]:
    """Which plan listed a chunk: its chunking and version (a new buffer, or the chunk's
    turn to load again, comes with a new version)."""
    return plan.n_items, plan.k, plan.version


class CoordinatedDataset(Protocol):
    """What the coordinator needs of its dataset (clients/dataset.py's CachedDataset)."""
    job: str
    digest: Any
    plan: SharedPlan

    def lookup(self, indices: Sequence[int], not_spare: bool = False) -> Sequence[int]: ...

    def prefetch(self, indices: Sequence[int]) -> Any: ...

    def check_open(self) -> None: ...


class JobRefused(ManagerError):
    """The manager refused to register the job: another holder of its name (its token) runs it."""


class _Closed(Exception):
    """close() has begun: the coordination thread makes no more manager calls."""


class JobCoordinator:
    def __init__(self, ds: CoordinatedDataset, manager: str, n_gpus: int = 1, report_seconds: float = 0.5,
                 prefetch_bandwidth: float = 20e6, quiet_report_seconds: float = 2.0,
                 keep_token: bool = True) -> None:
        self._unavailable = ManagerUnavailable
        self.ds = ds
        self.client = ManagerClient(manager)
        self.dataset = ds.digest.fingerprint.hex()
        self.plan: Plan | None = None
        self.report_seconds = report_seconds
        self.quiet_report_seconds = max(report_seconds, quiet_report_seconds)
        self._mode = "normal"  # what the manager's last reply said the servers apply to this job
        self.prefetch_bandwidth = prefetch_bandwidth
        self.reports = BatchReports()  # batch times for the manager (clients/batchreports.py)
        self._hits: LoaderHits | None = None  # the last loader's (watch_hits)
        # Each loader's epoch stream (watch_hits), held weakly: a loader dropped holds no chunk.
        # The coordinator's own hooks, called outside any loader's, serve the last loader's
        # stream, else _own (a job driving the coordinator itself).
        self._streams: weakref.WeakSet[ChunkReads] = weakref.WeakSet()
        self._own = ChunkReads(len(ds.digest))
        self._last: ChunkReads | None = None
        self._local = threading.local()  # .reads: the stream whose sampler hook runs in this thread
        self._released: dict[int, tuple[int, int, int]] = {}  # chunk -> _listing() it was released under
        self._release_after = 0.0  # no release is tried before this (monotonic) while the manager fails
        self._release_backoff = RELEASE_BACKOFF_S
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Held by the thread across its manager calls; close() takes it to set _closed: a step
        # that outlives close()'s wait then calls no manager through the closed client, nor
        # registers the job again after close() unregistered it.
        self._calls = threading.Lock()
        self._closed = False
        # Held across each call that answers this job's plan and the taking of its answer: the
        # manager answers them in the order they are taken, so a plan fetched before a chunk
        # release (same version, the released chunk still listed) never replaces the release's.
        self._plan_calls = threading.Lock()
        self.reached = False  # whether the manager has answered yet
        self._thread: threading.Thread | None = None
        # A lone process (no launcher secret) keeps its token of a named job for its next run.
        self._token_file = (JobTokenFile(manager, ds.job) if keep_token and jobtokens.launcher_secret() is None
                            else None)
        self._n_gpus = n_gpus
        self._kept: str | None = None  # the token claimed from the token file
        # (dataset tag, pipeline fingerprint) -> (costs, fixed) of every pipeline reported: a
        # registration made again is a new one to the manager, which counts the job on a
        # pipeline's transformed set only once that registration reported it, and loaders
        # report once (when made, or rekeyed)
        self._reported: dict[tuple[str, str], tuple[PipelineCosts, bool]] = {}
        # of them, those whose last report reached no manager (it may still count the job on
        # none): the thread sends them again
        self._unsent: set[tuple[str, str]] = set()
        # Set where an answer says the manager may have forgotten the job: the thread then reports
        # even with no batch queued, and that report's NOT_FOUND registers the job again.
        self._check = threading.Event()
        try:
            self._register(n_gpus)
        except BaseException:
            self.client.close()
            if self._token_file is not None:
                self._token_file.release()
            raise

    def _register(self, n_gpus: int) -> bool:
        """Register the job; False when the manager could not be reached."""
        ds, tf = self.ds, self._token_file
        # claimed once: claimed again by this very process, its own lock would refuse it
        if self._kept is None and tf is not None:
            self._kept = tf.claim()
        kept = self._kept
        if kept is not None:
            self.client.set_job_token(ds.job, kept)
        try:
            with self._plan_calls:
                info = self.client.register_job(ds.job, self.dataset, ds.digest.total_bytes, len(ds.digest), n_gpus)
                self._set_plan(info.plan)
        except self._unavailable as e:
            log.warning("cache manager %s unavailable (%s): training without a plan", self.client.address, e)
            return False
        except ManagerError as e:
            if e.code != grpc.StatusCode.PERMISSION_DENIED:
                raise
            raise JobRefused(f"{e}. {self._refused_hint(kept)}.", e.code) from None
        self.reached = True
        return True

    def _refused_hint(self, kept: str | None) -> str:
        tf = self._token_file
        if tf is None:
            return ("This process sent the token derived from its launcher's secret "
                    f"({jobtokens.SECRET_ENV} or torchrun's run id)" if jobtokens.launcher_secret() is not None
                    else "This process was given no job name, so it keeps no token")
        if kept is None:
            return f"This process sent no token: {tf.why_none}"
        return f"This process sent the token kept in {tf.path}, which is not the job's"

    def ring_spec(self) -> str | None:
        try:
            ring = self.client.get_ring()
            self.reached = True
        except self._unavailable:
            ring = self.client.last_ring()
        return ",".join(ring.addresses) if ring and ring.addresses else None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlcache-coordinator", daemon=True)
            self._thread.start()

    def _take_plan(self, call: Callable[[], Plan]) -> None:
        """Take the plan `call` (a manager call) answers, one such call at a time (_plan_calls)."""
        with self._plan_calls:
            self._set_plan(call())

    def _set_plan(self, plan: Plan) -> None:
        with self._lock:
            if self.plan is None or plan.version != self.plan.version or plan.chunks != self.plan.chunks:
                self.plan = plan
                self.ds.plan.publish(plan)

    # ---- hooks called by the loader and sampler (main process) ------------
    def watch_hits(self, sampler: Any) -> LoaderHits:
        """A loader's own hooks (batch_time, epoch_start, epoch_end): its ``sampler``'s ``stats``
        give each of its batches' hit fraction, sent with the batch's time to the manager, which
        regresses batch time on it to measure the job's benefit without bypass probes; its
        sampler's epochs are a stream of their own in the chunk accounting (consumed()). The
        coordinator's own batch_time, epoch_start and hooks serve the last sampler watched."""
        reads = ChunkReads(len(self.ds.digest))
        with self._lock:  # not while another thread's sampler hook walks the streams
            self._streams.add(reads)
        self._last = reads
        self._hits = LoaderHits(self.reports, sampler, lambda: self._new_epoch(reads),
                                scope=lambda: self._reading(reads), on_end=reads.end)
        self.reports.sampler = sampler
        return self._hits

    @contextlib.contextmanager
    def _reading(self, reads: ChunkReads) -> Iterator[None]:
        """The sampler hooks (consumed, expect) called under this count in `reads`."""
        before, self._local.reads = getattr(self._local, "reads", None), reads
        try:
            yield
        finally:
            self._local.reads = before

    def _current(self) -> ChunkReads:
        return getattr(self._local, "reads", None) or self._last or self._own

    def batch_time(self, end: float, duration: float) -> None:
        if self._hits is not None:
            self._hits.batch_time(end, duration)
        else:
            self.reports.add(end, duration)

    def _check_open(self) -> None:
        if self._closed:  # the manager client is closed: its calls raised a bare ValueError
            raise self._closed_error()

    def _closed_error(self) -> DatasetClosed:
        try:
            self.ds.check_open()  # the dataset's own words (its digest), closed before its coordinator
        except DatasetClosed as e:
            return e
        return DatasetClosed(f"the CachedDataset of job {self.ds.job} was closed: make a new one to read again")

    def consumed(self, batch: list[int]) -> None:
        """Count items read per chunk, in the stream of the loader whose sampler issued the
        batch; a chunk is released once every loader with an epoch in progress has read its
        items of it (this loader included; one with none to read there does not hold it).
        DatasetClosed once the dataset is closed (a loader made before, its workers' batches
        arriving late).

        The manager may re-chunk mid-epoch (a new DoubleBuffer: the budget or the servers
        changed, or its flags): items read are kept whatever the plan, and counted per chunk
        in the current chunking only, so counts of one chunking never stand for another's. A
        release answers the plan that listed the chunk; a later plan listing it again (a new
        buffer, or its turn again) is a new assignment, released once its items are read."""
        self._check_open()
        plan = self.plan
        reads = self._current()
        chunked = plan is not None and plan.option == Option.CHUNKED
        reads.mark(batch, plan, chunked)  # also under a full or no plan: a chunked one may follow
        if not chunked:
            return
        with self._lock:
            others = [s for s in self._streams if s.active and s is not reads]
        for c in plan.chunks:
            if (self._released.get(c) != _listing(plan) and reads.done(plan, c)
                    and all(s.done(plan, c) for s in others)):
                self._release(c, plan)

    def _release(self, c: int, plan: Plan) -> None:
        """Release a chunk read to the end. The call runs in the training loop's thread, so
        once the manager fails (each try may wait out the call's deadline, or it answers that it
        no longer knows the job) it is tried again only after a back-off that doubles, not after
        every batch."""
        now = time.monotonic()
        if now < self._release_after:
            return
        # not behind the coordination thread's plan call in flight (up to its deadline): the
        # training loop tries again at its next batch
        if not self._plan_calls.acquire(blocking=False):
            return
        self._released[c] = _listing(plan)
        try:
            with self._main_call():
                self._set_plan(self.client.release_chunk(self.ds.job, self.dataset, c))
        except ManagerError as e:  # down, or it forgot the job (restarted): never break training for it
            if not isinstance(e, self._unavailable):
                log.warning("releasing chunk %d failed (%s): trying again later", c, e)
                self._may_be_forgotten(e)  # NOT_FOUND: the coordinator's thread registers again
            self._released.pop(c, None)
            self._release_after = now + self._release_backoff
            self._release_backoff = min(2 * self._release_backoff, MAX_RELEASE_BACKOFF_S)
        else:
            self._release_backoff = RELEASE_BACKOFF_S
        finally:
            self._plan_calls.release()

    def epoch_start(self) -> None:
        if self._hits is not None:
            self._hits.epoch_start()  # then _new_epoch
        else:
            self._new_epoch(self._own)

    def _new_epoch(self, reads: ChunkReads) -> None:
        """A stream's epoch starts. Releases made in the job's epoch are forgotten (a chunk read
        again is released again) only where no other loader's epoch is in progress: one loader's
        eval epoch inside another's train epoch is not a new epoch of the job."""
        with self._lock:
            alone = not any(s.active for s in self._streams if s is not reads)
        if alone:
            self._released.clear()
        reads.start()

    def expect(self, items: Sequence[int] | None) -> None:
        """The items this epoch of the calling loader reads (None: all): a DDP rank's share,
        or what a resumed epoch has left. A chunk is released once those of its items are consumed."""
        self._current().expect(items)

    def prefer(self, i: int) -> bool:
        plan = self.plan
        return plan is not None and self.ds.plan.loading_first(i, plan.loading)

    def autocache_decision(self, dataset_tag: str, fingerprint: str, costs: PipelineCosts,
                           fixed: bool = False) -> Decision | None:
        """The manager's autocache decision for (dataset, pipeline prefix fingerprint),
        from this job's first-epoch ``costs`` and those of other jobs of the same
        pipeline (the first report decides; later jobs get the same answer). None
        when the manager cannot be reached or refuses (the job then decides alone:
        ``manager.policy.autocache.decide(costs)``). ``fixed``: the loader runs the
        pipeline transformed whatever the decision (autocache="transformed"). The
        report is made again whenever the job is registered again."""
        key = (dataset_tag, fingerprint)
        try:
            with self._main_call():  # DatasetClosed once closed
                with self._lock:
                    self._reported[key] = (costs, fixed)
                d = self._report_pipeline(dataset_tag, fingerprint, costs, fixed)
        except ManagerError as e:  # ManagerUnavailable included
            log.warning("autocache decision from the manager failed (%s): deciding alone", e)
            self._not_sent(key, (costs, fixed), e)
            return None
        with self._lock:
            if self._reported.get(key) == (costs, fixed):
                self._unsent.discard(key)
        self.reached = True
        return d

    def _not_sent(self, key: tuple[str, str], report: tuple[PipelineCosts, bool], e: ManagerError) -> None:
        """A pipeline report failed: one that reached no manager is sent again by the thread (it
        still counts this job on the pipeline only once a report arrives); NOT_FOUND: the job is
        registered again, which reports every pipeline again."""
        if isinstance(e, self._unavailable):
            with self._lock:
                if self._reported.get(key) == report:
                    self._unsent.add(key)
        else:
            self._may_be_forgotten(e)

    def _may_be_forgotten(self, e: ManagerError) -> None:
        """A call of this job's was refused: NOT_FOUND, or PERMISSION_DENIED (what ReportLoaded
        answers where the job is unknown under roles), may mean the manager forgot the job."""
        if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
            self._check.set()

    def _report_pipeline(self, dataset_tag: str, fingerprint: str, costs: PipelineCosts, fixed: bool) -> Decision:
        if fixed:  # only then: a manager client without the keyword still reports the rest
            return self.client.report_pipeline(self.ds.job, dataset_tag, fingerprint, costs, fixed=True)
        return self.client.report_pipeline(self.ds.job, dataset_tag, fingerprint, costs)

    def _report_pipelines_again(self) -> None:
        """After a registration made again: every pipeline reported before, reported again,
        so that the manager counts the job on their transformed sets. Their decisions are not
        taken: a running loader keeps its mode (a redecision applies to later jobs)."""
        with self._lock:
            reported = sorted(self._reported.items(), key=lambda kv: kv[0])
        for (tag, fp), (costs, fixed) in reported:
            try:
                self._report_pipeline(tag, fp, costs, fixed)
            except ManagerError as e:
                log.warning("reporting pipeline %s of job %s again failed (%s)", fp, self.ds.job, e)
                self._not_sent((tag, fp), (costs, fixed), e)
            else:
                with self._lock:
                    if self._reported.get((tag, fp)) == (costs, fixed):
                        self._unsent.discard((tag, fp))

    def _send_unsent(self) -> None:
        """Pipeline reports that reached no manager, sent again (their decisions are not taken,
        as after a registration made again). ManagerUnavailable leaves them for the next step."""
        with self._lock:
            todo = [(key, self._reported[key]) for key in sorted(self._unsent)]
        for (tag, fp), report in todo:
            try:
                self._report_pipeline(tag, fp, *report)
            except self._unavailable:
                raise
            except ManagerError as e:  # refused: sending it again would be refused again
                log.warning("reporting pipeline %s of job %s again failed (%s)", fp, self.ds.job, e)
                self._may_be_forgotten(e)
            with self._lock:
                if self._reported.get((tag, fp)) == report:
                    self._unsent.discard((tag, fp))

    # ---- background work --------------------------------------------------
    def period(self) -> float:
        """Seconds until the next report: short while a chunked plan loads and releases
        chunks or the job is being probed in bypass (both wait on reports), else quiet."""
        plan = self.plan
        busy = self._mode != "normal" or (plan is not None and plan.option == Option.CHUNKED)
        return self.report_seconds if busy else self.quiet_report_seconds

    @contextlib.contextmanager
    def _main_call(self) -> Iterator[None]:
        """A manager call of the training loop's (not the thread's): DatasetClosed once close()
        has begun, also where close() (in another thread) closes the client under the call."""
        self._check_open()
        try:
            yield
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!"
            if not self._closed:
                raise
            raise self._closed_error() from None

    @contextlib.contextmanager
    def _manager_open(self) -> Iterator[None]:
        """The thread's manager calls, each under this: _Closed once close() has begun."""
        with self._calls:
            if self._closed:
                raise _Closed
            yield

    def _step(self, last_loaded: float) -> float:
        """One round of the thread's work; returns when it last reported the loading chunk."""
        with self._manager_open():
            self._report()
            self._send_unsent()
        # One read of the plan: the main thread may swap it meanwhile (a released
        # chunk), and its `loading` may then be None. Nothing touches the dataset once
        # close() began: it closes the dataset's process state next, and a lookup or
        # prefetch would make that state again (its clients and threads leaked).
        plan = self.plan
        if plan is not None and plan.loading is not None and not self._stop.is_set():
            if time.monotonic() - last_loaded > 2.0:
                last_loaded = time.monotonic()
                self._report_loaded(plan, plan.loading)
            if not self._stop.is_set():
                self._prefetch(plan, plan.loading)
        return last_loaded

    def _run(self) -> None:
        last_loaded = 0.0
        while not self._stop.wait(self.period()):
            try:
                last_loaded = self._step(last_loaded)
            except _Closed:
                return
            except self._unavailable:
                continue  # the last plan holds
            except Exception as e:  # never let coordination break training
                if self._stop.is_set():  # cut short by close() (or the process's exit): expected
                    log.debug("cache coordination step ended by close()", exc_info=True)
                    return
                if isinstance(e, ManagerError) and e.code == grpc.StatusCode.NOT_FOUND:
                    self._register_again()
                else:
                    log.exception("cache coordination step failed")

    def _register_again(self) -> None:
        """The manager forgot the job (it expired, or restarted on an empty state dir)."""
        try:
            with self._manager_open():
                log.warning("cache manager %s no longer knows job %s: registering it again", self.client.address,
                            self.ds.job)
                if self._register(self._n_gpus):
                    self._report_pipelines_again()
                else:  # unreachable: the next step checks again, whether or not batches are queued
                    self._check.set()
        except _Closed:
            return
        except Exception:  # never let coordination break training: the next report tries again
            log.exception("registering job %s again failed", self.ds.job)

    def _report(self) -> None:
        """Report the queued batches (a failed report first, again under its number); with
        none, report only where an answer said the manager may have forgotten the job (an
        empty report journals nothing; NOT_FOUND if it forgot)."""
        batch = self.reports.next_report()
        checking = self._check.is_set()
        if not batch and not checking:
            return
        self._check.clear()  # a refusal of this report is not one to check again on
        try:
            reply = self.client.report_batches(self.ds.job, batch)
        except ManagerError as e:
            self.reports.failed(batch, e.code)  # sent again, whole, under its number, where still wanted
            if checking and isinstance(e, self._unavailable):
                self._check.set()
            raise
        self.reports.answered(reply.report_seq)
        self._mode = reply.mode
        if self.plan is None or reply.plan_version != self.plan.version:
            self._take_plan(lambda: self.client.get_plan(self.dataset, self.ds.job))

    def _report_queued(self) -> None:
        """close()'s last reports: every queued batch, REPORT_MAX a report (a failed one
        first), until none is left or a call fails."""
        for _ in range(QUEUED_MAX // REPORT_MAX + 2):  # the queue's bound, and a put-back report
            if not self.reports.queued:
                return
            self._report()

    @staticmethod
    def _chunk_sample(plan: Plan, chunk: int, n: int) -> list[int]:
        members = [i for r in plan.members(chunk) for i in r]
        return random.sample(members, min(n, len(members)))

    def _report_loaded(self, plan: Plan, chunk: int) -> None:
        sample = self._chunk_sample(plan, chunk, 256)
        if sample:
            present = self.ds.lookup(sample, not_spare=True)  # spare entries are not the chunk's room
            try:
                with self._manager_open():  # the look-up may have outlasted close()'s wait
                    self._take_plan(lambda: self.client.report_loaded(self.dataset, chunk, sum(present) / len(sample)))
            except ManagerError as e:
                self._may_be_forgotten(e)
                raise

    def _prefetch(self, plan: Plan, chunk: int) -> None:
        """Insert a few missing items of the loading chunk, at most prefetch_bandwidth bytes/s."""
        budget = self.prefetch_bandwidth * self.report_seconds
        sample = self._chunk_sample(plan, chunk, 64)
        missing = [i for i, p in zip(sample, self.ds.lookup(sample, not_spare=True)) if not p]
        take, size = [], 0
        for i in missing:
            size += int(self.ds.digest.size(i))
            if size > budget:
                break
            take.append(i)
        for k in range(0, len(take), PREFETCH_PART):
            if self._stop.is_set():
                return
            self.ds.prefetch(take[k:k + PREFETCH_PART])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)  # it stops after the prefetch part in hand
            if self._thread.is_alive():
                log.warning("the cache coordination thread of job %s did not stop within %g s (a store "
                            "read or cache look-up still runs)", self.ds.job, CLOSE_WAIT_S)
        with self._calls:  # after the thread's manager call in flight (its deadline), none more
            self._closed = True
        for last in (self._report_queued, lambda: self.client.unregister_job(self.ds.job)):
            try:  # a failed last report still unregisters the job
                last()
            except Exception:
                pass
        self.client.close()
        if self._token_file is not None:
            self._token_file.release()
