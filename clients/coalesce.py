"""Same-host request coalescing: concurrent misses of one item read the store once.

DataLoader workers are separate processes, and several jobs may share a host,
so coalescing uses a lock file per item in a shared tmpfs directory (flock
works across processes, and across threads since each claim opens its own
file description). A batch claims all its misses at once; it fetches and
inserts those it won, then waits for the others' winners and reads them from
the cache. Best effort: a waiter that times out, or then finds the item still
missing, fetches it itself, so correctness never depends on it.

The directory (one per dataset) is a shareddir.SharedDir: removed when its last user
leaves, or by a later user's sweep when its users ended without leaving (a crash,
os._exit): /dev/shm is memory, and would otherwise keep one per dataset ever read.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Sequence

from . import shareddir

DEFAULT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# One directory per user and dataset: a user joins only a directory of its own (shareddir:
# /dev/shm is everyone's), and users do not wait on each other's claims. Directories of
# clients from before these were removed ("mlcache-coalesce-*", no lock file) are left
# alone: such a client may still run, and would fail without its directory.
PREFIX = f"mlcache-coalescing-{os.geteuid()}-"
_swept: set[str] = set()  # roots swept by this process
_warned = False  # whether a batch that could not claim its misses was logged
log = logging.getLogger("clients.coalesce")


class Claim:
    def __init__(self, path: str) -> None:
        self.path, self._owned = path, False  # _owned: the file at path is this claim's to unlink
        for attempt in range(shareddir.ATTEMPTS):
            self.fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(self.fd)
                    raise
                self.first = False
                return
            # A winner unlinks its file as it lets go: a lock got after that is on a file nobody
            # else opens, while a newcomer makes a fresh one and wins too. Only the file at
            # path is this claim's to unlink; the last attempt reads the item anyway.
            self._owned = shareddir.same_file(self.fd, path)
            if self._owned or attempt == shareddir.ATTEMPTS - 1:
                self.first = True
                return
            os.close(self.fd)

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
        if self.first and self._owned:
            try:
                os.unlink(self.path)  # the next miss of this item starts afresh
            except FileNotFoundError:
                pass
        os.close(self.fd)  # releases the lock
        self.fd = -1


class HostCoalescer:
    """Claims of items under one namespace (a dataset), among the processes of this host."""

    def __init__(self, namespace: str, directory: str | None = None, wait_seconds: float = 30.0) -> None:
        root = directory or DEFAULT_DIR
        _sweep_once(root)
        self._shared = shareddir.SharedDir(root, PREFIX + namespace)
        self.dir = self._shared.path
        self.wait_seconds = wait_seconds

    def claim(self, key: bytes) -> Claim:
        return Claim(os.path.join(self.dir, key.hex()))

    def close(self) -> None:
        """Stop using the directory (removed if no other process uses it); no claims after this."""
        self._shared.close()


class BatchClaims:
    """The claims of a batch's misses, all released on leaving the `with` block, whatever
    raised. `mine`: positions this process reads (all of them without a coalescer);
    `others`: those another reader holds."""

    def __init__(self, coalescer: HostCoalescer | None, keys: Sequence[bytes]) -> None:
        self._claims: list[Claim] = []
        self._wait = coalescer.wait_seconds if coalescer is not None else 0.0
        try:
            for k in keys if coalescer is not None else ():
                self._claims.append(coalescer.claim(k))
        except OSError as e:  # out of descriptors (each claim holds one), /dev/shm full: it is
            self.release()    # best effort, so the batch reads every miss itself, not fails
            self._claims = []
            _warn_once(f"misses of a batch of {len(keys)} read without coalescing: {e}")
        except BaseException:
            self.release()
            raise
        won = [c.first for c in self._claims] if self._claims else [True] * len(keys)
        self.mine = [p for p, w in enumerate(won) if w]
        self.others = [p for p, w in enumerate(won) if not w]

    def __enter__(self) -> BatchClaims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release_mine(self) -> None:
        """Let the readers waiting for this one's items go (before waiting for theirs)."""
        for p in self.mine if self._claims else ():
            self._claims[p].release()

    def wait_others(self) -> None:
        """Wait until the other readers released their items, and let go. One time limit for
        the whole batch: a reader stuck on its items holds this batch up once, not per item."""
        deadline = time.monotonic() + self._wait
        for p in self.others:
            self._claims[p].wait(max(0.0, deadline - time.monotonic()))
            self._claims[p].release()

    def release(self) -> None:
        for c in self._claims:
            c.release()  # once: a released claim does nothing more


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s (warned once per process)", why)


def _sweep_once(root: str) -> None:
    """Remove this user's directories of root that users which ended without leaving left behind."""
    if root not in _swept:
        _swept.add(root)
        shareddir.sweep(root, PREFIX)
