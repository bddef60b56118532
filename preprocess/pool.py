"""The worker processes: started (spawned), grown and shrunk, watched, stopped.

Each worker has its own task queue, so the scheduler knows which items every
worker holds and can hand them to another if it dies, and its own result channel
(channel.py), so a worker killed mid-message blocks nobody. Shrinking sends a stop message, which a worker takes after its queued
tasks, finishing its background items first. Worker ids are reused lowest first
(a worker's statistics row in the dataset's shared counters is its id + 1),
except those of workers that died: a late message of theirs must not be taken
for a new worker's."""
from __future__ import annotations

import multiprocessing
import queue
import time
from typing import Any

from .channel import ChannelReader, channel, decode_frame, ready
from .pipeline import Pipeline
from .worker import worker_main

JOIN_SECONDS = 5.0
DEATH_SECONDS = 1.0  # for a worker whose message cannot be fetched to be seen dead
MAX_IDS = 128  # the shared counters' rows


def _context() -> Any:
    try:  # torch's queues pass tensors through shared memory
        import torch.multiprocessing as tmp
        return tmp.get_context("spawn")
    except ImportError:  # pragma: no cover
        return multiprocessing.get_context("spawn")


class WorkerDied(RuntimeError):
    pass


class WorkerPool:
    def __init__(self, ds: Any, pipeline: Pipeline, job_seed: int, feed: Any = None) -> None:
        self.ctx = _context()
        self.ds, self.pipeline, self.job_seed, self.feed = ds, pipeline, job_seed, feed
        self.procs: dict[int, Any] = {}
        self.queues: dict[int, Any] = {}
        self.results: dict[int, ChannelReader] = {}
        self.stopping: set[int] = set()  # sent a stop message, not yet exited
        self.retired: set[int] = set()   # died: ids not given out again
        # CPU seconds of the scheduler's thread reading and decoding the workers' outputs,
        # and the items they carried: the hand-off as the epochs run it (clients/automeasure.py)
        self.handoff_cpu_s, self.handoff_items = 0.0, 0

    @property
    def size(self) -> int:
        """Workers that will keep taking tasks."""
        return len(self.procs) - len(self.stopping)

    def active(self) -> list[int]:
        return [w for w in self.procs if w not in self.stopping]

    def send(self, wid: int, task: tuple) -> None:
        self.queues[wid].put(task)

    def resize(self, n: int) -> None:
        n = max(1, n)
        while self.size < n:
            free = set(range(MAX_IDS)) - set(self.procs) - self.retired
            if not free:
                raise WorkerDied(f"{len(self.retired)} preprocessing workers died; not starting more")
            wid = min(free)
            q = self.ctx.Queue()
            reader, w = channel(self.ctx)
            p = self.ctx.Process(target=worker_main, name=f"preprocess-{wid}", daemon=True,
                                 args=(wid, n, self.ds, self.pipeline, self.job_seed, q, w, self.feed))
            p.start()
            w.close()  # the worker's copy is the only write end: its death is our end of file
            self.procs[wid], self.queues[wid], self.results[wid] = p, q, reader
        for wid in sorted(self.active(), reverse=True)[:max(0, self.size - n)]:
            self.queues[wid].put(None)
            self.stopping.add(wid)

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
        it (its items are re-run: dead()). Any other failure is raised."""
        try:
            return decode_frame(frame)
        except Exception:
            p = self.procs[wid]
            p.join(DEATH_SECONDS)  # its shared memory is gone: it is dead or dying
            if p.exitcode in (0, None):
                raise
            return None

    def exited(self, wid: int) -> None:
        p = self.procs.pop(wid, None)
        if p is not None:
            self._forget(wid)  # closing its channel lets it go (ChannelWriter.finish)
            p.join(JOIN_SECONDS)
        self.stopping.discard(wid)

    def dead(self) -> list[int]:
        """Workers that died without being asked to stop (killed, crashed); forgotten.
        What they sent but the scheduler has not taken is dropped with them."""
        out = []
        for wid, p in list(self.procs.items()):
            if not p.is_alive() and p.exitcode not in (0, None):
                self.procs.pop(wid)
                self._forget(wid)
                self.stopping.discard(wid)
                self.retired.add(wid)
                out.append(wid)
        return out

    def _forget(self, wid: int) -> None:
        q = self.queues.pop(wid)
        q.cancel_join_thread()  # a task still being fed to a dead worker must not hold up our exit
        q.close()
        r = self.results.pop(wid, None)
        if r is not None:
            r.close()

    def drain_tasks(self) -> None:
        """Drop queued tasks (an epoch abandoned by its consumer), keeping stop messages."""
        for wid, q in self.queues.items():
            for _ in range(100000):
                try:
                    if q.get_nowait() is None:
                        q.put(None)
                        break
                except queue.Empty:
                    break

    def close(self) -> None:
        """Stop every worker: a stop message, JOIN_SECONDS for them to finish (what they
        still send is read and dropped undecoded, so none blocks on a full pipe), then terminate."""
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
