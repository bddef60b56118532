"""The life of one server client's same-host follower (localread.py): when it is opened,
dropped while the socket pays (readpath.py), reopened, tried again after a refusal's
back-off (readpath.OpenRetry), caught up for a get, and closed.

Opening asks the server to flush (OPEN_FOLLOWER, a round trip with the request timeout)
and has RocksDB open every table file: both happen outside the lock, by one thread at a
time, while the other threads' gets go over the socket instead of waiting for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from .localread import LocalReader, written_files
from .readpath import LOCAL, OpenRetry, ReadPaths

log = logging.getLogger("cacheserver.client")


class Refused(Exception):
    """The server did not take OPEN_FOLLOWER now (busy, or no answer in time): try later."""


class Follower:
    """One server client's follower; thread-safe. `open_reader(db_path)` asks the server and
    opens a LocalReader (Refused: not now; any other error: never, for this client)."""

    def __init__(self, address: str, paths: ReadPaths, open_reader: Callable[[str], LocalReader]) -> None:
        self.address = address
        self.paths = paths
        self._open_reader = open_reader
        self.db_path: str | None = None  # set while a follower may be opened
        self.local: LocalReader | None = None
        self.retry = OpenRetry()  # when an open the server refused for now is tried again
        self._lock = threading.Lock()  # held only to read and swap the fields above, never for a call
        self._opening = False  # one thread opens; the others read over the socket meanwhile

    def enable(self, db_path: str) -> LocalReader | None:
        """A follower of `db_path` may be opened: now, or once a refusal's back-off is over."""
        self.db_path = db_path
        return self.open()

    def current(self) -> LocalReader | None:
        """The follower to read from now, per the measured-cost policy (readpath.py)."""
        db_path = self.db_path  # read once: retire() may clear it meanwhile
        if db_path is None:
            return None
        files = written_files(db_path, self.paths.files_finished) if self.paths.wants_files() else None
        if not self.paths.use_local(files):
            self.drop()
            return None
        local = self.local
        return local if local is not None else self.open()

    def drop(self) -> None:
        # Dropped, not closed: a get in another thread may still hold it;
        # the last reference closes it, and nothing is replayed meanwhile.
        self.local = None

    def open(self) -> LocalReader | None:
        """The follower, opened now if there is none and an open is due; None while another
        thread opens it, while the server refuses for now, or for good (db_path None: no
        permission, an incompatible RocksDB, the data dir gone)."""
        with self._lock:
            db_path = self.db_path
            if self.local is not None or db_path is None or self._opening or not self.retry.due():
                return self.local
            self._opening = True
        local = installed = None
        try:
            local = self._try_open(db_path)
        finally:
            with self._lock:
                self._opening = False
                if local is not None and self.db_path == db_path:  # not retired or closed meanwhile
                    self.local = installed = local
        if local is not None and installed is None:  # nobody else would close it
            local.close()
        return installed

    def _try_open(self, db_path: str) -> LocalReader | None:
        try:
            local = self._open_reader(db_path)
        except Refused as e:  # a transient refusal must not cost the follower for good
            log.info("cache server %s: same-host follower not opened for now (%s); trying again "
                     "in %.1fs", self.address, e, self.retry.refused())
            return None
        except Exception as e:  # the socket path still works, slower: say why, once
            with self._lock:
                ours = self.db_path == db_path
                if ours:
                    self.db_path = None
            if ours:  # not an open cut short by close() or retire()
                log.warning("cache server %s: same-host reads go over its socket; no follower of %s (%s: %s)",
                            self.address, db_path, type(e).__name__, e)
            return None
        self.retry.opened()
        return local

    def read(self, local: LocalReader, ids: Sequence[bytes], want: list[int], out: list,
             ahead: tuple[list, float] | None = None) -> list[int]:
        """Fill out[i] for i in want from the follower (catching up once for what
        it lacks), or from `ahead` (all ids read before the answer came, and how
        long that took); the indices still missing."""
        t = time.perf_counter()
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
