"""Same-host request coalescing: concurrent misses of one item read the store once.

DataLoader workers are separate processes, and several jobs may share a host,
so coalescing uses a lock file per item in a shared tmpfs directory (flock
works across processes, and across threads since each claim opens its own
file description). A batch claims all its misses at once; it fetches and
inserts those it won, then waits for the others' winners and reads them from
the cache. Best effort: a waiter that times out, or then finds the item still
missing, fetches it itself, so correctness never depends on it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import time

DEFAULT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Claim:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.first = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(self.fd)
                raise
            self.first = False

    def wait(self, seconds: float) -> bool:
        """Wait until the winner released the item; False on time-out."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.002)

    def release(self) -> None:
        if self.fd < 0:
            return
        if self.first:
            try:
                os.unlink(self.path)  # the next miss of this item starts afresh
            except FileNotFoundError:
                pass
        os.close(self.fd)  # releases the lock
        self.fd = -1


class HostCoalescer:
    def __init__(self, namespace: str, directory: str | None = None, wait_seconds: float = 30.0) -> None:
        self.dir = os.path.join(directory or DEFAULT_DIR, f"mlcache-coalesce-{namespace}")
        os.makedirs(self.dir, exist_ok=True)
        self.wait_seconds = wait_seconds

    def claim(self, key: bytes) -> Claim:
        return Claim(os.path.join(self.dir, key.hex()))
