"""Store reads that hang: a warning that names the items, the path and the store,
repeated at a growing interval while the read stays in flight, and a line when it
goes on (docs/client.md, Errors: "A store read hangs").

A miss batch's store read (CachedDataset.read_store) is marked in flight in this
process's one ReadWatch (begin/end: a counter, a clock read and a dict entry, a few
hundred ns a batch; hits never come here). One daemon thread, started by the first
read, reads the marks; it ends after IDLE_EXIT_S with nothing in flight, and a
forked child starts afresh (spawned ones import this anew).

Nothing abandons a read: a Python thread cannot be stopped, and one left blocked in
a hung mount would keep its memory and its place in the fetch pool anyway."""
from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from preprocess.stall import check_seconds, due, look_every, seconds

from .digest import Kind

log = logging.getLogger("clients.readwatch")

READ_WARNING_S = 60.0  # default: seconds a store read may be in flight before a warning
IDLE_EXIT_S = 30.0  # the watcher thread ends after this long with no read in flight
SHOWN = 4  # items named in a warning; the rest are counted
ADVICE = ("check the store's mount (a hung NFS or FUSE mount such as gcsfuse) or the network to it; "
          "the read goes on (a store read is never abandoned) and the batch waits for it")

# (digest, item indices, warning seconds, started at (time.monotonic_ns))
Read = tuple[Any, Sequence[int], float, int]


def check(read_warning: float | None) -> None:
    check_seconds("read_warning", read_warning)


class ReadWatch:
    """Store reads in flight in this process, and the one thread that warns about them."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.reads: dict[int, Read] = {}
        self.shortest = math.inf  # the shortest warning time any read asked for: the watcher's period
        self.next: dict[int, float] = {}  # reads warned about: seconds of their next warning
        self._keys = itertools.count()
        self._lock = threading.Lock()  # starting and ending the thread
        self._warning = threading.Lock()  # a warning and its "went on" come once each, in that order
        self._thread: threading.Thread | None = None

    def begin(self, warn_s: float, digest: Any, indices: Sequence[int]) -> int:
        """Marks a read of these items in flight (from now); returns its key for end()."""
        if warn_s < self.shortest:
            self.shortest = warn_s
        key = next(self._keys)
        self.reads[key] = (digest, indices, warn_s, time.monotonic_ns())
        if self._thread is None:  # after the mark: a retiring watcher sees it, or this starts one
            self._start()
        return key

    def end(self, key: int) -> None:
        """The read is over; said so where it was warned about (here, at once: the process
        may end before the watcher looks again)."""
        r = self.reads.pop(key, None)
        if self.next and r is not None:  # empty but while a warned read is in flight
            with self._warning:
                if self.next.pop(key, None) is not None:
                    went_on(r, time.monotonic_ns())

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="store-read-watch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        me, idle = threading.current_thread(), 0.0
        while True:
            period = look_every(self.shortest)
            time.sleep(period)
            try:
                self.check()
            except Exception:  # a watcher must never end the reads it watches
                log.exception("the store read watcher failed")
            idle = 0.0 if self.reads else idle + period
            if idle >= IDLE_EXIT_S and self._retire(me):
                return

    def _retire(self, me: threading.Thread) -> bool:
        """Whether this thread may end: nothing in flight once it let go (a read begun
        since starts a new thread, or is watched on by this one)."""
        with self._lock:
            if self._thread is not me:
                return True
            self._thread = None
        if not self.reads:
            return True
        with self._lock:
            if self._thread is None:
                self._thread = me
                return False
        return True

    def check(self, now_ns: int | None = None) -> None:
        """Warns about the reads due a warning (`now_ns` taken before the reads are read:
        a watcher held up meanwhile must not count the delay as a read's time)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        for key, r in self.reads.copy().items():  # one C call: atomic under the GIL
            secs = (now - r[3]) / 1e9
            with self._warning:
                if due(self.next, key, secs, r[2]):
                    log.warning("store read of %s has been in flight for %s (%s); %s", describe(r[0], r[1]),
                                seconds(secs), where(), ADVICE)
                    if key not in self.reads and self.next.pop(key, None) is not None:  # ended meanwhile
                        went_on(r, time.monotonic_ns())

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()


def went_on(r: Read, now_ns: int) -> None:
    log.warning("store read of %s went on after %s", describe(r[0], r[1]), seconds((now_ns - r[3]) / 1e9))


def describe(digest: Any, indices: Sequence[int]) -> str:
    """The items (the first few, and a count), the first one's path and the store."""
    n = len(indices)
    shown = ", ".join(str(i) for i in indices[:SHOWN])
    what = f"item {shown}" if n == 1 else f"{n} items ({shown}{f' and {n - SHOWN} more' if n > SHOWN else ''})"
    path, offset, length = digest.location(indices[0])
    at = path if digest.kind is Kind.FILES else f"{path} @ {offset}+{length}"
    return f"{what}, the first at {at} in store {digest.root}"


def where() -> str:
    """This process, and its DataLoader worker where it is one (torch loaded already)."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return f"process {os.getpid()}" + (f", DataLoader worker {info.id}" if info is not None else "")


WATCH = ReadWatch()  # this process's; reset in a forked child, whose parent's reads and thread it lacks
os.register_at_fork(after_in_child=WATCH._reset)
