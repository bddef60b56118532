"""Scratch directories of same-host followers (localread.py), and their clean-up.

A RocksDB secondary needs a directory of its own (only its info log goes there). One
is made per reader and removed when the reader is closed or collected; but a process
that ends without either (a loader worker leaving by os._exit, a job killed) leaves its
directory behind, one per worker per epoch. So each directory holds an flock for as
long as its owner lives (the kernel drops it however the process ends, and it holds
across PID namespaces that share the directory), and the first reader of a process
removes the directories whose lock it can take: their owners are gone.

A directory is made and locked under a STAGING name the sweep leaves alone and only
then renamed to its PREFIX name, so no sweep can take a lock between the two."""
from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
import weakref

PREFIX = "mlcache-secondary-"
STAGING = ".mlcache-secondary-new-"
LOCK = ".owner"
STALE_S = 3600.0  # a directory with no lock this old: from an older client, or a crash while staging
_swept = False


def _release(name: str, fd: int, pid: int) -> None:
    # A forked child that inherited the reader must not remove its parent's directory.
    if os.getpid() == pid:
        shutil.rmtree(name, ignore_errors=True)
    os.close(fd)


class Scratch:
    """A scratch directory under the temp dir, held (locked) until close() or collection."""

    def __init__(self) -> None:
        sweep_once()
        staged = tempfile.mkdtemp(prefix=STAGING)
        try:
            fd = os.open(os.path.join(staged, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new, in a name no sweep takes
            name = os.path.join(os.path.dirname(staged), PREFIX + os.path.basename(staged)[len(STAGING):])
            os.rename(staged, name)
        except BaseException:
            os.close(fd)
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self.name = name
        self._release = weakref.finalize(self, _release, name, fd, os.getpid())

    def close(self) -> None:
        self._release()  # once: later calls do nothing


def sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep(tempfile.gettempdir())


def sweep(root: str) -> int:
    """Remove the scratch directories under root whose owner has ended; the number removed."""
    try:
        names = [n for n in os.listdir(root) if n.startswith((PREFIX, STAGING))]
    except OSError:
        return 0
    removed = 0
    for n in names:
        path = os.path.join(root, n)
        if n.startswith(STAGING):
            removed += _remove_if_stale(path)
            continue
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            removed += _remove_if_stale(path)
            continue
        except OSError:
            continue  # another user's, a link, or not a directory
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner lives
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.exists(path)
        finally:
            os.close(fd)
    return removed


def _remove_if_stale(path: str) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime <= STALE_S:  # lstat: a link is no dir
        return 0
    shutil.rmtree(path, ignore_errors=True)
    return int(not os.path.exists(path))
