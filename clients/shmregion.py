"""A region of shared memory for a process and the processes it starts.

One file in /dev/shm, unlinked at once and reserved whole with posix_fallocate when
made: a full /dev/shm is an OSError then, not a SIGBUS at some later first touch of a
page. It travels to a spawned process as a duplicated file descriptor, as
multiprocessing's own shared arenas do (a forked one inherits the mapping).
"""
from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen

SHM = "/dev/shm"  # Linux's memory filesystem for shared memory


class SharedRegion:
    """`size` bytes of shared memory: `view` is a memoryview of them."""

    def __init__(self, size: int, directory: str = SHM) -> None:
        fd, name = tempfile.mkstemp(prefix="mlcache-shm-", dir=directory)
        try:
            os.unlink(name)
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS in a worker
        except BaseException:
            os.close(fd)
            raise
        self._open(fd, size)

    def _open(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        try:
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.view = memoryview(self._map)
        weakref.finalize(self, _close, self.view, self._map, fd)

    def __reduce__(self) -> tuple:
        if get_spawning_popen() is None:  # elsewhere DupFd would park a duplicate that nothing closes
            raise RuntimeError("shared memory goes only to processes as they start")
        return _rebuild, (self.size, reduction.DupFd(self.fd))


def _rebuild(size: int, dupfd) -> SharedRegion:
    region = SharedRegion.__new__(SharedRegion)
    region._open(dupfd.detach(), size)
    return region


def _close(view: memoryview, mapping: mmap.mmap, fd: int) -> None:
    try:
        view.release()
        mapping.close()
    except BufferError:  # a slice of it is still in use somewhere: the mapping goes with it
        pass
    finally:
        os.close(fd)
