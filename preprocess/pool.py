"""The worker processes: started (spawned), grown and shrunk, watched, stopped.

Workers share one task queue and one result queue. Shrinking sends stop
messages, which a worker takes after its current task, finishing its background
items first; growing spawns new processes. Worker ids are reused, lowest first,
so a worker's statistics row (the dataset's shared counters) stays bounded."""
from __future__ import annotations

import multiprocessing
import queue
from typing import Any

from .pipeline import Pipeline
from .worker import worker_main

JOIN_SECONDS = 5.0


def _context() -> Any:
    try:  # torch's queues pass tensors through shared memory
        import torch.multiprocessing as tmp
        return tmp.get_context("spawn")
    except ImportError:  # pragma: no cover
        return multiprocessing.get_context("spawn")


class WorkerDied(RuntimeError):
    pass


class WorkerPool:
    def __init__(self, ds: Any, pipeline: Pipeline, job_seed: int, max_ids: int = 128) -> None:
        self.ctx = _context()
        self.ds, self.pipeline, self.job_seed = ds, pipeline, job_seed
        self.task_q = self.ctx.Queue()
        self.result_q = self.ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.stopping = 0  # stop messages sent, not yet answered by an exit
        self.max_ids = max_ids

    @property
    def size(self) -> int:
        """Workers that will keep taking tasks."""
        return len(self.procs) - self.stopping

    def resize(self, n: int) -> None:
        n = max(1, n)
        while self.size < n:
            wid = min(set(range(self.max_ids)) - set(self.procs))
            p = self.ctx.Process(target=worker_main, name=f"preprocess-{wid}", daemon=True,
                                 args=(wid, n, self.ds, self.pipeline, self.job_seed, self.task_q, self.result_q))
            p.start()
            self.procs[wid] = p
        while self.size > n:
            self.task_q.put(None)
            self.stopping += 1

    def exited(self, wid: int) -> None:
        p = self.procs.pop(wid, None)
        if p is not None:
            p.join(JOIN_SECONDS)
            self.stopping = max(0, self.stopping - 1)

    def check(self) -> None:
        """Raise if a worker died without being asked to stop (killed, crashed)."""
        for wid, p in list(self.procs.items()):
            if not p.is_alive() and p.exitcode not in (0, None):
                self.procs.pop(wid)
                raise WorkerDied(f"preprocessing worker {wid} (pid {p.pid}) died with exit code {p.exitcode}; "
                                 f"the items it held were not yielded")

    def drain_tasks(self) -> None:
        """Drop queued tasks (an epoch abandoned by its consumer)."""
        for _ in range(100000):
            try:
                task = self.task_q.get_nowait()
            except queue.Empty:
                return
            if task is None:  # a stop message: keep it
                self.task_q.put(None)
                return

    def close(self) -> None:
        for _ in self.procs:
            self.task_q.put(None)
        for p in self.procs.values():
            p.join(JOIN_SECONDS)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_SECONDS)
        self.procs.clear()
        self.task_q.close()
        self.result_q.close()
