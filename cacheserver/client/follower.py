"""The life of one server client's same-host follower (localread.py): when it is opened,
dropped while the socket pays (readpath.py), reopened, tried again after a refusal's
back-off (readpath.OpenRetry), caught up for a get, and closed.

Opening asks the server to flush (OPEN_FOLLOWER, a round trip with the request timeout)
and has RocksDB open every table file: both happen in a thread of their own, one open at a
time, and no get waits for them: a get that finds an open due starts it and goes over the
socket, as do the others meanwhile. Against a server that does not answer (hung, stopped),
the open inside a get cost its request timeout before the get's own request waited out a
second one, and a ring's other servers were sent nothing meanwhile. Only the first open, at
the client's resolution, is waited for, at most `wait_s` (the probe timeout, bounded):
a client's first gets read from the follower, as callers expect.

An open that fails for now (the server busy or silent, no fd or thread to be had, a table
file compacted away while RocksDB listed it) is tried again after a back-off; only one that
cannot go away (no permission, a store this RocksDB cannot read, the data dir gone: lasting())
gives the follower up for the client's life. A follower that could not catch up (no fd for
a new table file) reads nothing more, its gets go to the server, and is replaced after a
back-off: never RocksDB's error up through a get, never values the server may have replaced.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from .localread import LocalReader, written_files
from .readpath import LOCAL, OpenRetry, ReadPaths

log = logging.getLogger("cacheserver.client")
# The first open, at a client's resolution (inside its first call), is waited for at most
# this long (and no longer than the client's probe timeout): a store's RocksDB open
# takes ms to a second; past this, gets go over the socket until the open ends.
FIRST_OPEN_WAIT_S = 5.0


class Refused(Exception):
    """The server did not take OPEN_FOLLOWER now (busy, or no answer in time): try later."""


# What RocksDB says (its Status text: rocksdict raises a bare Exception) of a failure that
# opening again cannot mend: the files are not this process's to read, or not in a format
# this RocksDB reads (another version's, or damaged).
LASTING_TEXT = ("Permission denied", "Operation not permitted")
LASTING_STATUS = ("Corruption:", "Invalid argument:", "Not implemented:")


def lasting(err: BaseException, db_path: str) -> bool:
    """Whether a follower's failed open would fail again however long the client waits:
    no permission, a store this RocksDB cannot read, the data dir gone (its CURRENT file,
    which RocksDB only ever replaces by a rename, is missing), or an error that is none of
    RocksDB's or the system's (a bug). Anything else, a process out of fds (EMFILE) or
    memory, a table file compacted away while the open listed it, is tried again later."""
    if type(err) is not Exception and not isinstance(err, OSError):
        return True
    text = str(err)
    if any(t in text for t in LASTING_TEXT) or text.startswith(LASTING_STATUS):
        return True
    if "No such file or directory" in text and f"{os.sep}CURRENT:" in text:  # no store where it looked
        return True
    return not os.path.isfile(os.path.join(db_path, "CURRENT"))


class Follower:
    """One server client's follower; thread-safe. `open_reader(db_path)` asks the server and
    opens a LocalReader (Refused, or an error that is not lasting(): not now; a lasting one:
    never, for this client); it runs in a thread of its own (open_soon)."""

    def __init__(self, address: str, paths: ReadPaths, open_reader: Callable[[str], LocalReader]) -> None:
        self.address = address
        self.paths = paths
        self._open_reader = open_reader
        self.db_path: str | None = None  # set while a follower may be opened
        self.local: LocalReader | None = None
        self.retry = OpenRetry()  # when an open the server refused for now is tried again
        self._lock = threading.Lock()  # held only to read and swap these fields, never for a call
        self._opening: threading.Event | None = None  # set when the open under way (one at a time) ends

    def enable(self, db_path: str, wait_s: float = 0.0) -> LocalReader | None:
        """A follower of `db_path` may be opened: now (waited for up to `wait_s`), or in the
        background once that is over, or once a refusal's back-off is over."""
        self.db_path = db_path
        opening = self.open_soon()
        if opening is not None:
            opening.wait(wait_s)
        return self.local

    def current(self) -> LocalReader | None:
        """The follower to read from now, per the measured-cost policy (readpath.py); None
        while none is open (one due is opened in the background: this get goes over the socket)."""
        db_path = self.db_path  # read once: retire() may clear it meanwhile
        if db_path is None:
            return None
        files = written_files(db_path, self.paths.files_finished) if self.paths.wants_files() else None
        if not self.paths.use_local(files):
            self.drop()
            return None
        local = self.local
        if local is not None and local.failed is not None:  # behind the primary: a new one, later
            self._replace(local)
            local = None
        if local is None:
            self.open_soon()
        return local

    def _replace(self, local: LocalReader) -> None:
        with self._lock:
            if self.local is not local:  # another thread's get did it
                return
            self.local = None  # dropped, not closed: another get may still hold it
        log.info("cache server %s: same-host follower could not catch up (%s); reopening it in %.1fs",
                 self.address, local.failed, self.retry.refused())

    def drop(self) -> None:
        # Dropped, not closed: a get in another thread may still hold it;
        # the last reference closes it, and nothing is replayed meanwhile.
        self.local = None

    def open_soon(self) -> threading.Event | None:
        """Start opening the follower in a thread if there is none and an open is due; the
        open under way's Event (set once it ends), None if none is (one is open, the server
        refused for now, or for good: db_path None after a lasting() failure)."""
        with self._lock:
            db_path = self.db_path
            if self._opening is not None or self.local is not None or db_path is None or not self.retry.due():
                return self._opening
            opening = self._opening = threading.Event()
        try:
            threading.Thread(target=self._open, args=(db_path, opening), daemon=True,
                             name=f"follower-open {self.address}").start()
        except RuntimeError as e:  # no thread to be had now (a process at its limit): later
            self._opened(None, db_path, opening)
            log.info("cache server %s: same-host follower not opened for now (%s); trying again "
                     "in %.1fs", self.address, e, self.retry.refused())
        return opening

    def _open(self, db_path: str, opening: threading.Event) -> None:
        local = None
        try:
            local = self._try_open(db_path)
        finally:
            self._opened(local, db_path, opening)

    def _opened(self, local: LocalReader | None, db_path: str, opening: threading.Event) -> None:
        with self._lock:
            self._opening = None
            installed = local is not None and self.db_path == db_path  # not retired or closed meanwhile
            if installed:
                self.local = local
        opening.set()
        if local is not None and not installed:  # nobody else would close it
            local.close()

    def _try_open(self, db_path: str) -> LocalReader | None:
        try:
            local = self._open_reader(db_path)
        except Exception as e:  # the socket path still works, slower meanwhile
            if isinstance(e, Refused) or not lasting(e, db_path):  # not to cost the follower for good
                log.info("cache server %s: same-host follower not opened for now (%s: %s); trying again "
                         "in %.1fs", self.address, type(e).__name__, e, self.retry.refused())
                return None
            with self._lock:
                ours = self.db_path == db_path
                if ours:
                    self.db_path = None
            if ours:  # not an open cut short by close() or retire(): say why, once
                log.warning("cache server %s: same-host reads go over its socket; no follower of %s (%s: %s)",
                            self.address, db_path, type(e).__name__, e)
            return None
        self.retry.opened()
        return local

    def read(self, local: LocalReader, ids: Sequence[bytes], want: list[int], out: list,
             ahead: tuple[list, float, int | None] | None = None, generation: int | None = None) -> list[int]:
        """Fill out[i] for i in want from the follower (catching up once for what
        it lacks), or from `ahead` (all ids read before the answer came, how long that
        took, and the view they were read in); the indices still missing. `generation`: the
        server's, from its answer (ops.FLAG_GENERATION; None from a server without it): a view
        not known to include it catches up first, and what was read ahead in a view other than
        it is read again (another thread's catch-up may have made the view after that read)."""
        t = time.perf_counter()
        if generation is not None:
            if generation != local.view and local.sync(generation):  # a flush or replace since
                t1 = time.perf_counter()
                self.paths.follower(t1 - t)
                t = t1  # the catch-up is follower cost, not read time
            if ahead is not None and ahead[2] != generation:
                ahead = None
        if ahead is None:
            for i, v in zip(want, local.read([ids[i] for i in want])):
                out[i] = v
        else:
            t -= ahead[1]
            for i in want:
                out[i] = ahead[0][i]
        missing = [i for i in want if out[i] is None]
        if missing:
            t1 = time.perf_counter()
            if local.catch_up():
                t2 = time.perf_counter()
                self.paths.follower(t2 - t1)
                for i, v in zip(missing, local.read([ids[i] for i in missing])):
                    out[i] = v
                missing = [i for i in missing if out[i] is None]
                t += t2 - t1  # the catch-up is follower cost, not read time
                if self.paths.decide() != LOCAL:
                    self.drop()
        self.paths.local_read(time.perf_counter() - t, sum(len(out[i]) for i in want if out[i] is not None))
        return missing

    def retire(self) -> None:
        """No follower from now on; one in use is dropped, not closed (ServerClient.retire)."""
        with self._lock:
            self.local, self.db_path = None, None

    def close(self) -> None:
        """No follower from now on; the open one is closed (an open under way closes its own)."""
        with self._lock:
            local, self.local, self.db_path = self.local, None, None
        if local is not None:
            local.close()
