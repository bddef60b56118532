"""The worker processes: started (forked from a fork server: startctx.py), grown and shrunk, watched, stopped.

Each worker has its own task queue, so the scheduler knows which items every
worker holds and can hand them to another if it dies, and its own result channel
(channel.py), so a worker killed mid-message blocks nobody. Shrinking sends a stop message, which a worker takes after its queued
tasks, finishing its background items first. Worker ids are reused lowest first
(a worker's statistics row in the dataset's shared counters is its id + 1),
those of workers that died only once no other is left."""
from __future__ import annotations

import functools
import os
import pickletools
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from numbers import Integral
from typing import Any, TypeVar

from .channel import ChannelReader, channel, decode_frame, ready
from .pipeline import Pipeline
from .stall import NOT_RUNNING, Running, Slot
from .startctx import with_env, worker_context
from .worker import BACKGROUND, MAIN, SLOTS, worker_main

JOIN_SECONDS = 5.0
DEATH_SECONDS = 1.0  # for a worker whose message cannot be fetched to be seen dead
# an exit with status 0 but no exit message is a death once all it sent is read (its channel's
# end of file), or after this long if that never comes (a child of the worker holds the pipe)
SILENT_EXIT_SECONDS = 5.0
MAX_IDS = 128  # the shared counters' rows


class WorkerDied(RuntimeError):
    """Preprocessing workers died (more than the scheduler replaces in an epoch); the
    message says how each died and which items it was running and held."""


class PoolClosed(RuntimeError):
    """The pool was closed (the loader's close()) while an epoch still used it."""


F = TypeVar("F", bound=Callable[..., Any])


CLOSED_MESSAGE = ("the preprocessing workers were stopped (the loader's close()) while an epoch was still "
                  "running; iterate a loader only before closing it")


def _while_open(method: F) -> F:
    """Run under the pool's lock, refused once it is closed: an epoch's dispatcher thread
    may still be running when another thread closes the pool."""
    @functools.wraps(method)
    def guarded(self: WorkerPool, *args: Any, **kwargs: Any) -> Any:
        # closed: the lock is never taken again. At exit a daemon thread (the dispatcher) can
        # be frozen by the interpreter's finalization while it holds it; taking it then would
        # hang the exit (the iterator's clean-up at teardown)
        if self.closed:
            raise PoolClosed(CLOSED_MESSAGE)
        with self.lock:
            if self.closed:
                raise PoolClosed(CLOSED_MESSAGE)
            return method(self, *args, **kwargs)
    return guarded  # type: ignore[return-value]


def _stop_workers(procs: dict[int, Any], lock: Any, ended: threading.Event) -> None:
    """The pool was garbage-collected, or the interpreter exits, without close(): its workers
    go with it. Under the pool's lock, and closed first: an epoch's dispatcher still running
    at exit fails with PoolClosed instead of replacing the workers it saw die, and holds the
    lock no more (a daemon thread frozen at exit holding it hung the iterator's finalization)."""
    with lock:
        ended.set()
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(JOIN_SECONDS)


def _message_head(frame: bytes, n: int = 4) -> list:
    """The first n plain values of a message's pickle (kind, run, worker, item), read
    without unpickling it; fewer where the pickle does not start so."""
    head: list = []
    try:
        for op, arg, _ in pickletools.genops(frame):
            if op.name in ("PROTO", "FRAME", "MARK", "MEMOIZE"):
                continue
            if arg is None or len(head) == n:
                break
            head.append(arg)
    except Exception:  # a malformed pickle: as far as it went
        pass
    return head


def is_whole(v: Any) -> bool:
    """A count given as an int (numpy's too), not a bool (True would be 1), float or str."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def exit_cause(exitcode: int | None) -> str:
    """How a worker process ended, from its exit status (negative: the signal)."""
    if exitcode is None:
        return "closed its result channel while it ran (and was killed by the scheduler)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (as the out-of-memory killer does)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    if exitcode == 0:
        return "exited with status 0 without being asked to stop (os._exit or a library ending the process)"
    hint = " (often an exception nothing caught: its traceback is on stderr)" if exitcode == 1 else ""
    return f"exited with status {exitcode}{hint}"


class WorkerPool:
    def __init__(self, ds: Any, pipeline: Pipeline, job_seed: int, feed: Any = None) -> None:
        self.ctx = worker_context(ds, pipeline, feed)
        self.ds, self.pipeline, self.job_seed, self.feed = ds, pipeline, job_seed, feed
        self.procs: dict[int, Any] = {}
        self.queues: dict[int, Any] = {}
        self.results: dict[int, ChannelReader] = {}
        self.stopping: set[int] = set()  # sent a stop message, not yet exited
        self.retired: set[int] = set()   # died: ids given out again only once no other is left
        self.lost: set[int] = set()      # exited, a message of theirs dropped (_decode): dead whatever it said
        self.exited_at: dict[int, float] = {}  # first seen exited with status 0, no exit message yet
        self.running: dict[int, Any] = {}  # the items each worker's two threads run (worker.py)
        # dead workers: (how, [(item, the run it was sent in), ...] of what their threads were running)
        self.deaths: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        # CPU seconds of the scheduler's thread reading and decoding the workers' outputs,
        # and the items they carried: the hand-off as the epochs run it (clients/automeasure.py)
        self.handoff_cpu_s, self.handoff_items = 0.0, 0
        self.lock, self._ended = threading.RLock(), threading.Event()  # _ended: closed, or its workers stopped
        self.epoch: Any = None  # the engine.EpochRun running on these workers: one at a time
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.lock, self._ended)

    @property
    def closed(self) -> bool:
        return self._ended.is_set()

    @property
    def size(self) -> int:
        """Workers that will keep taking tasks."""
        return len(self.procs) - len(self.stopping)

    @_while_open
    def active(self) -> list[int]:
        return [w for w in self.procs if w not in self.stopping]

    @_while_open
    def send(self, wid: int, task: tuple) -> None:
        self.queues[wid].put(task)

    @_while_open
    def resize(self, n: int) -> None:
        if not is_whole(n):
            raise TypeError(f"the number of preprocessing workers must be an int, got {n!r}")
        n = max(1, int(n))
        if n > MAX_IDS:
            raise ValueError(f"at most {MAX_IDS} preprocessing workers (a row of statistics each), got {n}")
        while self.size < n:
            wid = self._free_id()
            q = self.ctx.Queue()
            reader, w = channel(self.ctx)
            running = self.ctx.RawArray("q", [NOT_RUNNING] * SLOTS)  # read after its death: no lock
            p = self.ctx.Process(target=with_env, name=f"preprocess-{wid}", daemon=True,
                                 args=(dict(os.environ), worker_main, wid, n, self.ds, self.pipeline,
                                       self.job_seed, q, w, self.feed, running))
            p.start()
            w.close()  # the worker's copy is the only write end: its death is our end of file
            self.procs[wid], self.queues[wid], self.results[wid] = p, q, reader
            self.running[wid] = running
        for wid in sorted(self.active(), reverse=True)[:max(0, self.size - n)]:
            self.queues[wid].put(None)
            self.stopping.add(wid)

    def _free_id(self) -> int:
        """The lowest id neither in use nor retired; once none is left, the lowest retired
        one: dead() forgot a dead worker's channel and slots, so nothing of its can be taken
        for its successor's (workers ended for step_timeout retire theirs too: over a long
        job they would run out, and the pool with them)."""
        free = set(range(MAX_IDS)) - set(self.procs)
        wid = min(free - self.retired or free)
        self.retired.discard(wid)
        return wid

    @_while_open
    def receive(self, timeout: float, decode: bool = True) -> list[tuple]:
        """The messages the workers have sent, waiting at most timeout seconds for one."""
        out: list[Any] = []
        wids = {id(r): wid for wid, r in self.results.items()}
        for r in ready(list(self.results.values()), timeout):
            t0 = time.thread_time()
            frames = r.read(decode=False)
            out += [self._decode(wids[id(r)], f) for f in frames] if decode else frames
            self.handoff_cpu_s += time.thread_time() - t0
        msgs = [m for m in out if m is not None]
        if decode:
            self.handoff_items += sum(1 for m in msgs if m[0] == "done")
        return msgs

    def _decode(self, wid: int, frame: bytes) -> tuple | None:
        """A worker's message; None for one a killed worker sent whose tensors went with
        it (its items are re-run: dead()); a living worker's item that does not unpickle
        here: that item's error."""
        try:
            return decode_frame(frame)
        except Exception as e:
            p = self.procs[wid]
            p.join(DEATH_SECONDS)  # its shared memory is gone: it is dead or dying
            if p.exitcode is None:
                return self._undecodable(wid, frame, e)
            # status 0 too: a clean exit waits until all it sent is read, so this one died (dead())
            self.lost.add(wid)
            return None

    def _undecodable(self, wid: int, frame: bytes, error: Exception) -> tuple:
        """A living worker's item whose output pickled there but does not unpickle here (a
        class whose __reduce__ does not give back what it takes): that item's error, as
        one that cannot be pickled (worker._advance), so on_error applies and it is named."""
        head = _message_head(frame)
        if len(head) < 4 or head[0] != "done":
            raise RuntimeError(f"a message from preprocessing worker {wid} cannot be unpickled in the "
                               f"loader's process ({type(error).__name__}: {error})") from error
        last = self.pipeline.order[-1]
        text = "".join(traceback.format_exception(error)) + (
            f"{type(error).__name__}: its output cannot be unpickled in the loader's process: {error}\n")
        return ("error", head[1], wid, head[3], last, self.pipeline.steps[last].name, text, [])

    @_while_open
    def exited(self, wid: int) -> None:
        if wid in self.lost:
            return  # its exit message came, but a message before it was dropped: dead() re-runs its items
        p = self.procs.pop(wid, None)
        if p is not None:
            self._forget(wid)  # closing its channel lets it go (ChannelWriter.finish)
            p.join(JOIN_SECONDS)
        self.stopping.discard(wid)

    @_while_open
    def dead(self) -> list[int]:
        """Workers gone without the exit handshake (killed, crashed, exited with any status
        without their exit message, their channel closed without it); forgotten. What
        they sent but the scheduler has not taken is dropped with them."""
        out = []
        for wid, p in list(self.procs.items()):
            if not self._gone(wid, p):
                continue
            if p.is_alive():  # its channel's end of file came first: it is dying, or reports nothing more
                p.join(DEATH_SECONDS)  # the exit status says how it died
            killed = p.is_alive()
            if killed:
                p.kill()
                p.join(JOIN_SECONDS)
            how = exit_cause(None if killed else p.exitcode)
            if wid in self.lost and not killed:
                how += "; a message it sent could not be read (its shared memory went with it)"
            self.deaths[wid] = (how, self._items_running(wid))
            self.procs.pop(wid)
            self._forget(wid)
            self.stopping.discard(wid)
            self.retired.add(wid)
            out.append(wid)
        return out

    def _items_running(self, wid: int) -> list[tuple[int, int]]:
        """(item, run) of each of worker wid's threads that runs one."""
        running = self.running.get(wid)
        if running is None:
            return []
        return [r for r in (Slot(running, k).current() for k in (MAIN, BACKGROUND)) if r[0] != NOT_RUNNING]

    @_while_open
    def progress(self) -> list[Running]:
        """The steps the workers' threads run: ((worker, thread, run), item, step, started);
        run: the run (engine.EpochPlan.run) the item was sent in, which tells an item an
        earlier epoch left behind from this epoch's copy of it."""
        out = []
        for wid, running in self.running.items():
            for k in (MAIN, BACKGROUND):
                r = Slot(running, k).read()
                if r is not None:
                    out.append(((wid, k, r[3]), *r[:3]))
        return out

    @_while_open
    def kill(self, wid: int) -> None:
        """End worker wid at once (a step of its over step_timeout: a thread cannot be
        stopped, its process can); dead() then reports it and its items."""
        p = self.procs.get(wid)
        if p is not None and p.is_alive():
            p.kill()
            p.join(JOIN_SECONDS)

    def pid(self, wid: int) -> int | None:
        p = self.procs.get(wid)
        return None if p is None else p.pid

    def death(self, wid: int) -> str:
        """How worker wid died and the items it was running then (dead() has returned it)."""
        how, running = self.deaths.get(wid, ("is not known to have died", []))
        return f"worker {wid} {how}" + (f", running items {[i for i, _ in running]}" if running else "")

    def _gone(self, wid: int, p: Any) -> bool:
        """Is worker wid dead without having said goodbye? An exit message read marks
        the end of its channel (ChannelWriter.finish) and the scheduler calls exited()."""
        alive, r = p.is_alive(), self.results.get(wid)
        if not alive and (p.exitcode != 0 or wid in self.lost):
            return True
        if r is None or r.ended:
            return False
        if r.closed:  # end of file, no end mark: its last messages never came
            return True
        if alive:
            return False
        # status 0 (sys.exit, os._exit(0) in a step) with its channel still open: read on
        first = self.exited_at.setdefault(wid, time.monotonic())
        return time.monotonic() - first > SILENT_EXIT_SECONDS

    def _forget(self, wid: int) -> None:
        q = self.queues.pop(wid)
        q.cancel_join_thread()  # a task still being fed to a dead worker must not hold up our exit
        q.close()
        r = self.results.pop(wid, None)
        if r is not None:
            r.close()
        self.running.pop(wid, None)
        self.lost.discard(wid)
        self.exited_at.pop(wid, None)

    def drain_tasks(self) -> None:
        """Drop queued tasks (an epoch abandoned by its consumer), keeping stop messages."""
        if self.closed:  # no lock once closed (see _while_open)
            return
        with self.lock:
            if not self.closed:
                self._drain_tasks()

    def _drain_tasks(self) -> None:
        for q in self.queues.values():
            for _ in range(100000):
                try:
                    if q.get_nowait() is None:
                        q.put(None)
                        break
                except queue.Empty:
                    break

    def close(self) -> None:
        """Stop every worker: a stop message, JOIN_SECONDS for them to finish (what they
        still send is read and dropped undecoded, so none blocks on a full pipe), then terminate.
        An epoch still running then fails with PoolClosed (its calls wait for the lock)."""
        if self.closed:  # no lock once closed (see _while_open)
            return
        with self.lock:
            if not self.closed:
                self._close()
                self._finalizer()  # closed from here on

    def _close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        deadline = time.monotonic() + JOIN_SECONDS
        while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
            self.receive(0.05, decode=False)
            for wid in [w for w, r in self.results.items() if r.ended]:
                self.results.pop(wid).close()  # all read: it may go (ChannelWriter.finish)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
            p.join(JOIN_SECONDS)
        for wid in list(self.procs):
            self._forget(wid)
        self.procs.clear()
