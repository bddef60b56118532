"""A lock shared by the processes of a loader (the main one, its DataLoader and preprocessing
workers) that a process killed while holding it does not keep held.

A multiprocessing Lock is a bare semaphore: a worker killed inside it (SIGKILL, the OOM killer,
torch's terminate() of a worker that outlived its shutdown's wait) left it taken for good, and
every later acquire of every process waited out its whole timeout: the loader statistics' pair
lock cost 5 s a read, for the dataset's life; their row-claim lock 30 s and then an error for
every new worker. Here the holder's process id is kept beside the lock, and a waiter that finds
that process gone takes the lock over (it then holds it, and releases it as its own).
"""
from __future__ import annotations

import multiprocessing
import os
import time

POLL_S = 0.05  # a waiter looks at the holder this often (held for microseconds, it is free by then)


def alive(pid: int) -> bool:
    """Whether process `pid` runs: not gone, not a zombie (a killed child its parent has not
    reaped yet, as a DataLoader's dead worker until its iterator shuts down, holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or gone meanwhile: as kill(0) said
        return True


class OwnedLock:
    """acquire(timeout) / release() across processes (spawn context: it travels to a process
    as it starts, pickled); a holder's death frees it for the next waiter (module docstring)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._holder = ctx.RawValue("q", 0)  # the holding process's id; 0: none known
        self._takeover = ctx.Lock()  # held for a moment: one waiter alone takes a dead holder's place

    def acquire(self, timeout: float) -> bool:
        """Take the lock within `timeout` seconds: free, or held by a process that died."""
        if self._lock.acquire(False):  # free, as nearly always: no clock read
            self._holder.value = os.getpid()
            return True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self._lock.acquire(timeout=max(0.0, min(POLL_S, left))):
                self._holder.value = os.getpid()
                return True
            if self._take_over():
                return True
            if left <= 0:
                return False

    def _take_over(self) -> bool:
        """The lock, from a holder that died holding it (it never released: its id stayed)."""
        holder = self._holder.value
        if holder == 0 or alive(holder):
            return False
        if not self._takeover.acquire(timeout=POLL_S):
            return False
        try:
            if self._holder.value != holder:  # another waiter took it over first
                return False
            self._holder.value = os.getpid()
            return True
        finally:
            self._takeover.release()

    def release(self) -> None:
        self._holder.value = 0  # before the release: a holder named is one that holds it
        self._lock.release()
