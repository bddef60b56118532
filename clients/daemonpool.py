"""A thread pool whose threads are daemons: for store reads, which may block for good (a hung
mount, a FIFO, a stalled disk) and cannot be broken off. concurrent.futures' own pool joins
every thread of every pool at the interpreter's exit, without a bound: one read that never
returns kept the process from exiting at all, even after CachedDataset.close().

As concurrent.futures' pool, a thread holds no reference to its pool (only a weak one): a pool
dropped without shutdown() (a dataset dropped without close) lets its idle threads end."""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


def _work(pool_ref: weakref.ref, tasks: queue.SimpleQueue, idle: threading.Semaphore) -> None:
    """A thread's loop: tasks until a None (shutdown, or its pool collected). `pool_ref` is
    held, never used: while it lives, its callback wakes this thread when the pool is collected."""
    while True:
        item = tasks.get()
        if item is None:  # shutdown or collected: one per thread
            return
        f, fn, args, kwargs = item
        del item
        if f.set_running_or_notify_cancel():
            try:
                f.set_result(fn(*args, **kwargs))
            except BaseException as e:
                f.set_exception(e)
        del f, fn, args, kwargs  # the task's data must not outlive it in an idle thread
        idle.release()


class DaemonPool(Executor):
    """Up to `max_workers` daemon threads, started as tasks arrive; what an exit leaves
    running is abandoned, not waited for (the process's exit bound: procstate.close_after)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "daemon-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"DaemonPool needs max_workers >= 1, got {max_workers}")
        self._max_workers, self._prefix = max_workers, thread_name_prefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one per thread waiting for a task
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            f: Future = Future()
            self._queue.put((f, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                self._start_thread()
        return f

    def _start_thread(self) -> None:
        tasks, threads = self._queue, self._threads

        def collected(_: weakref.ref) -> None:  # no shutdown(): each thread is told to end
            for _t in threads:
                tasks.put(None)

        t = threading.Thread(target=_work, args=(weakref.ref(self, collected), tasks, self._idle),
                             name=f"{self._prefix}_{len(threads)}", daemon=True)
        t.start()
        threads.append(t)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                threads = []
            else:
                self._shutdown, threads = True, list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join()
