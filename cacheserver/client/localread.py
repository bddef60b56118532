"""Same-host fast path: read values straight from the server's RocksDB files.

The client opens the store as a RocksDB *secondary* (read-only follower) and
asks the server, over the Unix socket, only which ids are present (GET_LOCAL):
the server still applies bypass mode, counts hits and orders eviction, while
the bytes never cross a socket. Safe under the security model: the files hold
only ciphertext under derived ids (docs/security.md), or in an embedded cache's
plain dir (datadir.py) its owner's own items, and the reader needs
file access to the data dir, i.e. the same machine and the server's group.
A value the follower cannot see yet (written after its last catch-up, or not
yet flushed: with --durability cache values skip the log the follower
replays) or that fails its checksum is left for the server to serve.
A value the follower holds in an older version than the server (a replace put's, flushed
after the follower's view was made) is no miss: the server's answer says which generation
of its files to read (ops.FLAG_GENERATION), and the follower catches up first when its view
is not known to include that one (sync).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence

import rocksdict

from ..record import unwrap
from ..rocksopts import filtered, plain_read_options
from ..store import hot_read_options, tuned_for_reads
from .scratch import Scratch

# Catching up replays the primary's log: ~0.1 s under heavy logged writes, ~1 ms
# when values skip the log (--durability cache). Space catch-ups in proportion to
# their cost, so they take at most ~1/CATCH_UP_SPACING of the time, within bounds.
CATCH_UP_SPACING = 5.0
MIN_CATCH_UP_INTERVAL = 0.02  # seconds
MAX_CATCH_UP_INTERVAL = 0.5
# A read catches up first once the last catch-up is this old: the misses that start catch-ups
# do not come under a read-mostly load, and the follower served a value the server had since
# replaced (a poisoned value's repair) for as long as the process ran. Cheap with nothing to replay.
MAX_STALE_S = 1.0


TABLE_FILES = (".sst", ".blob")  # written once under their final names, then only deleted


def written_files(db_path: str, finished: Mapping[str, int] | None = None) -> dict[str, int]:
    """Sizes of the primary's write-ahead logs, table files and blob files, by name:
    what a follower replays (the logs' growth) or must open (the table files that
    flushes and compactions made since it last caught up; blob files it never reads,
    but each flush of them writes table files of their index entries). Table and
    blob files are written once: those in `finished` keep their size there,
    unstatted, so a look at a store of thousands of files costs one directory
    listing and a few stats."""
    finished = finished or {}
    out: dict[str, int] = {}
    try:
        with os.scandir(db_path) as it:
            for e in it:
                name = e.name
                if name in finished and name.endswith(TABLE_FILES):
                    out[name] = finished[name]
                elif name.endswith((".log", *TABLE_FILES)):
                    try:
                        out[name] = e.stat().st_size
                    except FileNotFoundError:  # a compaction deleted it meanwhile
                        continue
    except OSError:
        pass
    return out


def catch_up_interval(cost_s: float) -> float:
    """Seconds to wait after a catch-up that took cost_s before the next one."""
    return min(MAX_CATCH_UP_INTERVAL, max(MIN_CATCH_UP_INTERVAL, CATCH_UP_SPACING * cost_s))


class LocalReader:
    def __init__(self, db_path: str, plain: bool = False) -> None:
        self._scratch = Scratch()
        t = time.monotonic()
        cf = filtered(rocksdict.Options(raw_mode=True))
        try:
            self._db = rocksdict.Rdict(db_path, tuned_for_reads(rocksdict.Options(raw_mode=True)),
                                       column_families={"meta": cf, "server": cf},
                                       access_type=rocksdict.AccessType.secondary(self._scratch.name))
        except BaseException:
            self._scratch.close()
            raise
        # a plain store's values (datadir.py) carry no trailer: RocksDB checks their blocks instead
        self._plain = plain
        self._db.set_read_options(plain_read_options() if self._plain else hot_read_options())
        self._lock = threading.Lock()  # catch-ups and close() one at a time
        self.closed = False
        # why a catch-up failed (no fd for a new table file, a MANIFEST rolled over meanwhile):
        # behind the primary from then on, it reads nothing more and is replaced (follower.py)
        self.failed: str | None = None
        self._last_catch_up = time.monotonic()
        # The server's generation (Store.generation) last caught up to after an answer reported it:
        # the view holds every flush and replace counted up to it. None: none yet (an open racing a
        # flush may lack the flush and the old value's logged delete both).
        self.view: int | None = None
        # opening replays the log as a catch-up does, and more: a conservative first cost
        self._interval = catch_up_interval(self._last_catch_up - t)

    def read(self, ids: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """The values under these ids (None: absent or unreadable, and all of them once
        closed or failed): a plain store's as RocksDB's bytes (no copy: the caller keeps
        them), a sealed one's past the trailer."""
        if time.monotonic() - self._last_catch_up >= MAX_STALE_S:
            self.catch_up()
        if self.failed is not None:  # never a value the server may have replaced since
            return [None] * len(ids)
        get = self._db.get
        out: list[bytes | memoryview | None] = []
        for k in ids:
            try:
                raw = get(k)
            except Exception:  # a file compacted away since the last catch-up, a corrupt block, closed
                raw = None
            out.append(None if raw is None else raw if self._plain else unwrap(raw))
        return out

    def catch_up(self) -> bool:
        """Follow the primary's newest writes, unless the last catch-up was too recent
        for its cost (catch_up_interval), or the reader is closed (a get in another thread
        may still hold it: what it lacks is read over the socket), or failed to catch up."""
        with self._lock:
            if time.monotonic() - self._last_catch_up < self._interval:
                return False
            return self._catch_up()

    def sync(self, generation: int) -> bool:
        """Catch up now, however recent the last catch-up, unless the view is known to include
        `generation`, which an answer received before this call reported: values the server
        answered LOCAL may be older in a view from before (a replace's, flushed since). Any
        other generation than the view's (newer, or a restarted server's) counts as unseen.
        Returns whether it caught up; where it could not (closed, failed) reads give None."""
        with self._lock:
            if generation == self.view:  # another thread's sync did it
                return False
            if not self._catch_up():
                return False
            self.view = generation  # this catch-up began after that answer came
            return True

    def _catch_up(self) -> bool:
        if self.closed or self.failed is not None:  # lock held
            return False
        t = time.monotonic()
        try:
            self._db.try_catch_up_with_primary()
        except Exception as e:  # rocksdict's errors: the get goes to the server, not up to training
            self.failed = f"{type(e).__name__}: {e}"
            return False
        self._last_catch_up = time.monotonic()
        self._interval = catch_up_interval(self._last_catch_up - t)
        return True

    def close(self) -> None:
        with self._lock:  # not in the middle of a catch-up
            self.closed = True
            try:
                self._db.close()
            finally:
                self._scratch.close()
