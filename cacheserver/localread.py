"""Same-host fast path: read values straight from the server's RocksDB files.

The client opens the store as a RocksDB *secondary* (read-only follower) and
asks the server, over the Unix socket, only which ids are present (GET_LOCAL):
the server still applies bypass mode, counts hits and orders eviction, while
the bytes never cross a socket. Safe under the security model: the files hold
only ciphertext under derived ids (docs/security.md), and the reader needs
file access to the data dir, i.e. the same machine and the server's group.
A value the follower cannot see yet (written after its last catch-up, or not
yet flushed: with --durability cache values skip the log the follower
replays) or that fails its checksum is left for the server to serve.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Sequence

import rocksdict

from .record import unwrap
from .store import hot_read_options, tuned_for_reads

CATCH_UP_INTERVAL = 0.5  # seconds; catching up replays the primary's log, ~0.1 s


def log_bytes(db_path: str) -> int:
    """Size of the primary's write-ahead logs: what a follower would replay."""
    try:
        with os.scandir(db_path) as it:
            return sum(e.stat().st_size for e in it if e.name.endswith(".log"))
    except OSError:
        return 0


class LocalReader:
    def __init__(self, db_path: str) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="mlcache-secondary-")
        cf = rocksdict.Options(raw_mode=True)
        self._db = rocksdict.Rdict(db_path, tuned_for_reads(rocksdict.Options(raw_mode=True)),
                                   column_families={"meta": cf, "server": cf},
                                   access_type=rocksdict.AccessType.secondary(self._scratch.name))
        self._db.set_read_options(hot_read_options())
        self._lock = threading.Lock()
        self._last_catch_up = time.monotonic()

    def read(self, ids: Sequence[bytes]) -> list[memoryview | None]:
        get = self._db.get
        out: list[memoryview | None] = []
        for k in ids:
            try:
                raw = get(k)
            except Exception:  # a file compacted away since the last catch-up
                raw = None
            out.append(None if raw is None else unwrap(raw))
        return out

    def catch_up(self) -> bool:
        """Follow the primary's newest writes, at most every CATCH_UP_INTERVAL."""
        with self._lock:
            if time.monotonic() - self._last_catch_up < CATCH_UP_INTERVAL:
                return False
            self._db.try_catch_up_with_primary()
            self._last_catch_up = time.monotonic()
            return True

    def close(self) -> None:
        self._db.close()
        self._scratch.cleanup()
