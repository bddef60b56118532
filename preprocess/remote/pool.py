"""The remote workers of one job: Ray actors running PrefixRunner, one task queue each.

Worker states: starting (configured; takes one task, queued by Ray behind its
configuration, until it answers one) -> running -> draining (removed by a scaling decision,
starting ones first: takes no new task, is killed once its queued tasks are done, a starting
one at once; a scale-up takes it back before starting any worker) -> gone; or dead (its
process died, or Ray reports it unavailable, or it cannot take the job's spec (a step's module
not installed there: each of its tasks would fail at once, and it would take the most): it is
killed all the same, lest it come back and run on unaccounted; its unfinished tasks are
reported failed, and unless it was draining
it is replaced, at most `max_replace` times over the pool's life; once deaths have used those
up, a scale-up starts no worker either: they would crash alike). Workers that no node of the
cluster can take (each asks for more than any node has) are not started: Ray would keep them
pending for ever, each holding a task (the pool breaks, naming the resource); one Ray reports
it cannot schedule is killed and not replaced, and no other is started: all ask alike.

A task is a few item indices; its result is a small report (runner.Report). A
failed task's items are simply not in the cache: the trainer computes them (so
nothing is lost, and nothing doubled: which items an epoch yields is the
sampler's business). Any Ray error other than a dead actor (the connection
lost, the cluster gone; or the last worker taking tasks is one Ray cannot schedule), and
a worker no node can take, break the pool: one warning, no further Ray call but a bounded attempt to kill its
workers where the connection stays open (another pool shares it, or it is the user's),
the job goes on with local workers.

Three threads use a pool: the feeder's (submit, wait, poll: remote/feeder.py), the loader's
dispatcher (resize, by the controller as it takes a batch) and the trainer's (refresh, close). Every call holds the pool's lock, but for
a wait's Ray calls (in slices of WAIT_SLICE_S, so that a stop or a close is seen at once); a
closed pool makes no Ray call again (a call still under way in another thread ends without
one)."""
from __future__ import annotations

import functools
import itertools
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .cluster import leave, stays_open
from .runner import FAILED, PrefixRunner, Report, SpecMismatch
from .spec import WorkSpec


KILL_WAIT_S = 5.0  # a lost cluster stalls each call for Ray's reconnect grace period
WAIT_SLICE_S = 0.25  # a wait's longest Ray call: a stop or a close() asked meanwhile is seen this soon
CLOSE_LOCK_S = 5.0  # close() waits this long for a call in another thread (a stalled Ray call), then goes on


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run under the pool's lock (a call from the other thread waits for this one)."""
    @functools.wraps(method)
    def locked(self: "RemotePool", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


def unschedulable(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for an actor it cannot place (not RayActorErrors): that worker's fault,
    unless no other can be placed either."""
    ex = ray.exceptions
    return tuple(getattr(ex, n) for n in ("ActorUnschedulableError", "ActorPlacementGroupRemoved")
                 if hasattr(ex, n))


class Unplaceable(RuntimeError):
    """No live node of the Ray cluster has what a worker asks for: none can start."""


def check_placeable(ray: Any, needs: dict[str, float]) -> None:
    """Unplaceable, naming the resource, where no live node nor launchable node type has all of `needs` (Ray keeps
    such an actor pending for ever, without an error)."""
    if not needs:
        return
    nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")] + launchable_nodes(ray)
    if any(all(r.get(k, 0.0) >= v for k, v in needs.items()) for r in nodes):
        return
    most = {k: max((r.get(k, 0.0) for r in nodes), default=0.0) for k in needs}
    short = [k for k, v in needs.items() if most[k] < v] or list(needs)  # else: none has all at once
    raise Unplaceable(f"no live node of the Ray cluster (nor a node type its autoscaler starts) has {', '.join(f'{k}: {needs[k]:g}' for k in short)} "
                      f"for a remote worker (of {len(nodes)} nodes the largest has "
                      f"{', '.join(f'{k}: {most[k]:g}' for k in short)}); ask for less (start(cpus=))")


def launchable_nodes(ray: Any) -> list[dict[str, float]]:
    """The resources of each node type an autoscaler may still start (the cluster config that
    Ray's autoscaler publishes, as Ray Train reads it): an actor no live node can take may
    be what makes it start one. Empty where there is none (a fixed cluster) or no such API."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:
        return []
    groups = getattr(config, "node_group_configs", None) or []
    return [dict(g.resources) for g in groups if g.max_count != 0]


def kill_all(ray: Any, handles: list[Any], timeout: float | None = None) -> None:
    """Best effort, bounded: kill these actors from a thread of its own, waiting for it at
    most `timeout` seconds (KILL_WAIT_S; a kill of a dead actor is a no-op, one that fails
    says the connection is gone, and the rest would fail alike)."""
    def run() -> None:
        for h in handles:
            try:
                ray.kill(h)
            except Exception:
                return

    if handles:
        t = threading.Thread(target=run, name="ray-kill", daemon=True)
        t.start()
        t.join(KILL_WAIT_S if timeout is None else timeout)


@dataclass
class Worker:
    wid: int
    handle: Any
    queued: int = 0            # items in its unfinished tasks
    draining: bool = False
    finished: int = 0          # tasks it has answered

    @property
    def on_probation(self) -> bool:
        """Not known to run yet (starting, or no CPU for it in the cluster): one task at a
        time, so a worker that never starts holds back one task, not every batch."""
        return self.finished == 0 and self.queued > 0


@dataclass
class Task:
    wid: int
    epoch: int
    indices: list[int]
    version: int = 0           # of the spec it was sent for
    sent: float = field(default_factory=time.monotonic)


@dataclass
class PoolCounts:
    tasks: int = 0
    items: int = 0
    made: int = 0
    present: int = 0
    failed: int = 0            # items a worker could not make (the trainer made them)
    lost: int = 0              # items of tasks whose worker died, or was stopped first, or whose cluster went
    deaths: int = 0
    seconds: float = 0.0       # work reported by the workers


class RemotePool:
    def __init__(self, ray: Any, spec: WorkSpec, *, cpus: float = 1.0, max_replace: int = 8,
                 share: int | None = None) -> None:
        self.ray, self.spec = ray, spec
        self.actor_cls = ray.remote(num_cpus=cpus, max_restarts=0, max_task_retries=0)(PrefixRunner)
        self.needs = {"CPU": float(cpus)} if cpus > 0 else {}  # what each worker asks a node for
        self.unplaceable: str | None = None  # why Ray could not schedule a worker: none is started since
        self.workers: dict[int, Worker] = {}
        self.tasks: dict[Any, Task] = {}
        self.target = 0
        self.max_replace, self.replaced = max_replace, 0
        self.unreplaced = 0  # deaths of workers taking tasks that no replacement was left for
        self.share = share  # of the connection cluster.connect() made; None: the user's, left open
        self.broken: str | None = None
        self.counts = PoolCounts()
        self.closed = False
        self._lock = threading.RLock()
        self._ids = itertools.count()

    # ---- size ------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Workers taking tasks (draining ones excluded)."""
        return sum(not w.draining for w in self.workers.values())

    @property
    def starting(self) -> int:
        """Workers taking tasks that have not answered one yet (Ray still starting them)."""
        return sum(not w.draining and w.finished == 0 for w in self.workers.values())

    @property
    def exhausted(self) -> bool:
        """Deaths have used up the replacements (workers that crash on every task must not
        come back at each scaling decision either), or Ray could not schedule a worker (the
        others ask for the same)."""
        if self.unplaceable is not None:
            return True
        return self.replaced >= self.max_replace and (self.replaced > 0 or self.unreplaced > 0)

    @_locked
    def resize(self, n: int) -> None:
        """Take draining workers back, start workers (none once `exhausted`, none where no
        node can take one: the pool breaks), or drain workers until `n` take tasks: those
        still starting first (they do no work yet; stopped at once), then the least loaded."""
        self.target = max(0, n)
        if not self._live():
            return
        try:
            self._undrain()
            if self.size < self.target and not self.exhausted:
                check_placeable(self.ray, self.needs)  # once for all: each would pend for ever
            while self.size < self.target and not self.exhausted and not self.closed:
                self._start()
            if self.size < self.target and not self.closed:
                self._warn_once_exhausted()
            live = sorted((w for w in self.workers.values() if not w.draining),
                          key=lambda w: (w.finished > 0, w.queued))
            for w in live[:max(0, self.size - self.target)]:
                w.draining = True
            self._stop_drained()
        except Exception as e:
            self._break(e)

    @_locked
    def set_spec(self, spec: WorkSpec) -> None:
        """A new version of the job's spec (the pipeline was reordered): every worker
        takes it before its next task."""
        self.spec = spec
        if self._live():
            try:
                for w in self.workers.values():
                    w.handle.configure.remote(spec)
            except Exception as e:
                self._break(e)

    def _undrain(self) -> None:
        """Draining workers run and hold their CPUs: a scale-up takes them back (those known
        to run first) rather than start actors that would wait for CPUs behind them."""
        draining = sorted((w for w in self.workers.values() if w.draining), key=lambda w: -w.finished)
        for w in draining[:max(0, self.target - self.size)]:
            w.draining = False

    _exhausted_warned = False

    def _warn_once_exhausted(self) -> None:
        if not self._exhausted_warned:
            self._exhausted_warned = True
            if self.unplaceable is not None:
                warnings.warn(f"a remote worker could not be scheduled ({self.unplaceable}): no more are started; "
                              f"{self.size} run, {self.target} asked", RuntimeWarning, stacklevel=3)
                return
            warnings.warn(f"remote workers died and were replaced {self.replaced} times (max_replace="
                          f"{self.max_replace}): no more are started; {self.size} run, {self.target} "
                          f"asked", RuntimeWarning, stacklevel=3)

    def _start(self) -> None:
        wid = next(self._ids)
        handle = self.actor_cls.options(name=None).remote()
        if self.closed:  # by a close() that could not wait for this start: the worker goes at once
            kill_all(self.ray, [handle])
            return
        handle.configure.remote(self.spec)
        self.workers[wid] = Worker(wid, handle)

    def _stop_drained(self) -> None:
        """Kill the draining workers with no queued task, and those not started yet: one
        pending for a CPU would hold its task until one frees (its items go to the trainer)."""
        for w in [w for w in self.workers.values() if w.draining and (w.queued == 0 or w.finished == 0)]:
            del self.workers[w.wid]
            try:
                self.ray.kill(w.handle)
            except Exception as e:
                self._break(e)
                return

    # ---- tasks -----------------------------------------------------------------
    @_locked
    def submit(self, epoch: int, indices: list[int]) -> Any | None:
        """Queue a task on the least loaded worker; its ref, or None (no worker free to
        take it: none, all on probation, or the pool broken)."""
        live = [w for w in self.workers.values() if not w.draining and not w.on_probation]
        if not live or not indices or not self._live():
            return None
        w = min(live, key=lambda w: w.queued)
        try:  # a client ref is hashed once the server answers: a lost cluster shows here too
            ref = w.handle.run.remote(self.spec.version, epoch, list(indices))
            self.tasks[ref] = Task(w.wid, epoch, list(indices), self.spec.version)
        except Exception as e:
            self._break(e)
            return None
        w.queued += len(indices)
        self.counts.tasks += 1
        self.counts.items += len(indices)
        return ref

    def wait(self, refs: list[Any], timeout: float, stop: threading.Event | None = None) -> list[Any]:
        """Wait up to `timeout` for these tasks, or until `stop` is set (the epoch was left);
        settles those finished; returns the refs still running (all of them once the pool is
        broken or closed: the caller moves on). The lock is not held while Ray waits."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                if not self._live():
                    return []
                todo = [r for r in refs if r in self.tasks]
            if not todo:
                return []
            try:
                done, rest = self.ray.wait(todo, num_returns=len(todo),
                                           timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except Exception as e:
                with self._lock:
                    self._break(e)
                return []
            with self._lock:
                for r in done:
                    if self.broken or self.closed:  # a settle broke the pool (it counted the other
                        return []                    # tasks lost), or another thread closed it
                    self._settle(r)
                if self.broken or self.closed:
                    return []
            if not rest or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                return list(rest)
            refs = rest

    def poll(self) -> None:
        """Settle whatever has finished, without waiting."""
        self.wait(list(self.tasks), 0.0)

    def _settle(self, ref: Any) -> None:
        task = self.tasks.pop(ref, None)
        if task is None:  # dropped meanwhile (stop_draining; a close() that could not wait for the lock)
            return
        w = self.workers.get(task.wid)
        if w is not None:
            w.queued -= len(task.indices)
        try:
            report: Report = self.ray.get(ref, timeout=30)
        except self.ray.exceptions.RayActorError:
            self.counts.lost += len(task.indices)
            self._died(task.wid)
            return
        except unschedulable(self.ray) as e:
            self.counts.lost += len(task.indices)
            self._unschedulable(task.wid, e)
            return
        except self.ray.exceptions.RayTaskError as e:  # the runner raised (e.g. no ring): a failed task
            if w is not None:
                w.finished += 1
            self.counts.failed += len(task.indices)
            self._warn_once_task(e)
            if self._refused_spec(task, e):  # every task of its would fail so: it takes none more
                self._died(task.wid)
            self._stop_drained()  # a drained worker's last task may be a failed one
            return
        except Exception as e:
            self.counts.lost += len(task.indices)
            self._break(e)
            return
        if w is not None:
            w.finished += 1
        self._count(report)
        self._stop_drained()

    def _refused_spec(self, task: Task, e: BaseException) -> bool:
        """The worker could not take the spec this task was sent for, the current one (its
        configure failed: a step's module missing on its node). A task of an older version
        refused after a set_spec is not that: the worker has the newer one."""
        cause = e if isinstance(e, SpecMismatch) else getattr(e, "cause", None)
        return isinstance(cause, SpecMismatch) and task.version == self.spec.version

    def _count(self, report: Report) -> None:
        c = self.counts
        for _, seconds, status in report:
            c.seconds += seconds
            if status == "made":
                c.made += 1
            elif status == "present":
                c.present += 1
            elif status.startswith(FAILED):
                c.failed += 1

    def _unschedulable(self, wid: int, e: BaseException) -> None:
        """Ray cannot place this worker: a dead one, not replaced, and no worker is started
        since (all ask for the same: one by one they would each wait to fail alike); unless
        no other worker takes tasks: then nothing remote can run, and the pool breaks."""
        w = self.workers.get(wid)
        if w is None:
            return  # killed already, on another of its tasks
        self.unplaceable = self.unplaceable or f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if not w.draining and not any(not o.draining for o in self.workers.values() if o is not w):
            self._break(e)
            return
        self._died(wid)

    def _died(self, wid: int) -> None:
        """A worker's process died, Ray reports it unavailable (it may come back) or cannot
        schedule it: kill it, forget it (its other tasks fail, or count, as they settle)
        and, unless it was draining already, start another while replacements are left."""
        w = self.workers.pop(wid, None)
        if w is None:
            return
        self.counts.deaths += 1
        try:  # an unavailable worker that came back would run on unaccounted, holding its CPU
            self.ray.kill(w.handle)
        except Exception as e:
            self._break(e)
            return
        if w.draining or self.closed:  # closed meanwhile (by a close() that could not wait): none starts
            return
        if self.unplaceable is not None:
            return
        if self.replaced >= self.max_replace:
            self.unreplaced += 1
            return
        try:
            check_placeable(self.ray, self.needs)  # its node gone: no other may take a replacement
            self.replaced += 1
            self._start()
        except Exception as e:
            self._break(e)

    _task_warned = False

    def _warn_once_task(self, e: BaseException) -> None:
        if not self._task_warned:
            self._task_warned = True
            warnings.warn(f"a remote preprocessing task failed (its items are made locally): {e}",
                          RuntimeWarning, stacklevel=3)

    def _live(self) -> bool:
        """May Ray be called? Not once broken, nor once the client connection is closed
        (Ray would then start or join a cluster of its own on the next call)."""
        if self.broken or self.closed:
            return False
        if not self.ray.is_initialized():
            self._break(ConnectionError("the Ray Client connection is closed"))
            return False
        return True

    def _break(self, e: BaseException) -> None:
        """The cluster is gone (or the connection to it): one warning, no more Ray calls
        but a bounded try to kill the workers where the error was a passing one on a
        connection that stays open (closing it would end them)."""
        if self.broken or self.closed:  # closed: its workers are stopped already, nothing is lost now
            return
        self.broken = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        self.counts.lost += sum(len(t.indices) for t in self.tasks.values())
        self.tasks.clear()
        handles = [w.handle for w in self.workers.values()]
        self.workers.clear()
        warnings.warn(f"remote preprocessing workers lost ({self.broken}); the job goes on with local "
                      f"workers", RuntimeWarning, stacklevel=3)
        if handles and stays_open(self.ray, self.share):
            kill_all(self.ray, handles)
        self._leave()

    def _leave(self) -> None:
        """Give up this pool's share of the connection, once (another pool may hold one)."""
        share, self.share = self.share, None
        leave(self.ray, share)

    @_locked
    def stop_draining(self) -> None:
        """Kill the draining workers now, without waiting for their queued tasks (what they make
        would not be read: a paused controller's); those tasks count as lost, their items are the
        trainer's. Where a kill fails the pool breaks (that counts the rest)."""
        if not self._live():
            return
        gone = {wid for wid, w in self.workers.items() if w.draining}
        for wid in gone:
            w = self.workers.pop(wid)
            try:
                self.ray.kill(w.handle)
            except Exception as e:
                self._break(e)
                return
        self._drop_tasks(lambda t: t.wid in gone)

    def _drop_tasks(self, which: Any) -> None:
        """Forget the unfinished tasks ``which`` picks, counting their items lost."""
        for ref in [r for r, t in self.tasks.items() if which(t)]:
            self.counts.lost += len(self.tasks.pop(ref).indices)

    def close(self) -> None:
        """Stop every worker (without waiting for their tasks: their items count as lost) and give
        up this pool's share of the connection (the last share leaves the cluster). A call of
        another thread stalled in Ray holding the lock is waited for CLOSE_LOCK_S at most: the pool
        is closed all the same (the dicts replaced, not changed under that call's loops), and that
        call makes no Ray call after its own."""
        locked = self._lock.acquire(timeout=CLOSE_LOCK_S)
        try:
            if self.closed:
                return
            self.closed = True
            workers, self.workers = list(self.workers.values()), {}
            tasks, self.tasks = list(self.tasks.values()), {}
            if not self.broken and self.ray.is_initialized():  # bounded: the cluster may be lost unnoticed
                kill_all(self.ray, [w.handle for w in workers])
            self.counts.lost += sum(len(t.indices) for t in tasks)
            self._leave()
        finally:
            if locked:
                self._lock.release()
