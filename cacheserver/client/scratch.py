"""Scratch directories of same-host followers (localread.py), and their clean-up.

A RocksDB secondary needs a directory of its own (its info log). One is made per
reader and removed when the reader closes; but a process that ends without closing
(a loader worker leaving by os._exit, a job killed) leaves its directory behind, one
per worker per epoch. So each directory holds an flock for as long as its owner lives
(the kernel drops it however the process ends, and it holds across PID namespaces
that share the directory), and the first reader of a process removes the directories
whose lock it can take: their owners are gone."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

PREFIX = "mlcache-secondary-"
LOCK = ".owner"
_swept = False


class Scratch:
    """A scratch directory under the temp dir, held (locked) until close()."""

    def __init__(self) -> None:
        sweep_once()
        self.name = tempfile.mkdtemp(prefix=PREFIX)
        self._fd: int | None = os.open(os.path.join(self.name, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # new and ours: never contended

    def close(self) -> None:
        if self._fd is None:
            return
        shutil.rmtree(self.name, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep(tempfile.gettempdir())


def sweep(root: str) -> int:
    """Remove the scratch directories under root whose owner has ended; the number removed."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return 0
    removed = 0
    for n in names:
        path = os.path.join(root, n)
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR)
        except FileNotFoundError:
            # made before owners held a lock, or by a reader between mkdtemp and its lock:
            # only the former is old
            if _older_than(path, 3600):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
            continue
        except OSError:
            continue  # another user's, or not a directory
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner lives
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed += 1
    return removed


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False
