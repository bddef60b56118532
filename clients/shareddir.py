"""Directories that processes of one host use together, removed once none of them does.

clients/coalesce.py keeps a directory per dataset in /dev/shm (memory) that every process
of a loader, and every job reading that dataset on the host, uses at once. They are cleaned
as cacheserver/client/scratch.py cleans its one-owner directories: each user holds an flock
on the directory's LOCK file for as long as it uses it (shared here; the kernel drops it
however the process ends), a directory whose lock can be taken exclusively has no user
left, and it is removed by the user that leaves last or, after a crash, by a later user's
sweep. A directory is made and locked under a STAGING name (a hidden one the sweep removes
only when stale) and only then renamed into place, so none is ever seen without its lock.

Many users need two steps more. A remover renames the directory away while it holds the
lock exclusively, so that nobody can join it after that; and a user that got its shared
lock checks that the lock file is still the one under the directory's name, else a remover
took the directory away while it waited, and it joins afresh."""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import time
import weakref

LOCK = ".owner"  # as scratch.py's
STALE_S = 3600.0  # a hidden (staging, or half removed) directory this old was left by a crash
ATTEMPTS = 100  # joins that found the directory removed under them before giving up
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


class SharedDir:
    """root/name, used by this process (made if need be) until close(), its collection or
    the end of the process; the last user to leave removes it."""

    def __init__(self, root: str, name: str) -> None:
        self.path = os.path.join(root, name)
        fd = _join(self.path)
        self._leave = weakref.finalize(self, _leave, self.path, fd)

    def close(self) -> None:
        self._leave()  # once: later calls do nothing


def _leave(path: str, fd: int) -> None:
    os.close(fd)  # drops this user's lock, unless a forked child still holds the same open file
    remove_unused(path)


def _join(path: str) -> int:
    """A descriptor of path's lock file holding a shared lock on it: path is in use."""
    lock = os.path.join(path, LOCK)
    for _ in range(ATTEMPTS):
        try:
            fd = os.open(lock, _OPEN)
        except FileNotFoundError:
            fd = _make(path)
            if fd is None:
                continue  # another process made it first: join theirs
            return fd
        try:
            _check_mine(fd, path)  # before the lock: another user's could be held for good
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a remover: it holds the lock only to rename
            if same_file(fd, lock):
                return fd
        except FileNotFoundError:  # renamed away by a remover since the open: join afresh
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # taken away while this waited
    raise OSError(errno.EAGAIN, f"cannot use {path}: it is not a directory with a {LOCK} file, or it keeps "
                                f"being removed")


def _make(path: str) -> int | None:
    """Make path with its lock file, locked shared by this process; None if path exists."""
    root, name = os.path.split(path)
    staged = tempfile.mkdtemp(prefix=f".{name}-new-", dir=root)
    try:
        fd = os.open(os.path.join(staged, LOCK), _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # in a name no sweep takes: nobody else knows it yet
        os.rename(staged, path)  # fails on a directory that holds something (its lock file)
        return fd
    except BaseException as e:
        os.close(fd)
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return None
        raise


def remove_unused(path: str) -> bool:
    """Remove the shared directory at path if no process uses it; whether it did."""
    lock = os.path.join(path, LOCK)
    try:
        fd = os.open(lock, _OPEN)
    except OSError:
        return False  # gone already; or not one of these (no lock file, a link, another user's)
    try:
        try:
            _check_mine(fd, path)  # another user's is theirs to remove
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # in use
        if not same_file(fd, lock):
            return False  # removed, and maybe made again, between the open and the lock
        root, name = os.path.split(path)
        gone = os.path.join(root, f".{name}-old-{secrets.token_hex(6)}")
        try:
            os.rename(path, gone)  # nobody can join it any more
        except OSError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def sweep(root: str, prefix: str) -> int:
    """Remove the shared directories under root named prefix... that nobody uses, and
    their stale staging or half removed ones; the number removed."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    removed = 0
    for n in names:
        if n.startswith(prefix):
            removed += remove_unused(os.path.join(root, n))
        elif n.startswith("." + prefix):
            removed += remove_stale(os.path.join(root, n), STALE_S)
    return removed


def remove_stale(path: str, seconds: float) -> bool:
    """Remove the directory at path if nothing changed in it for `seconds`; whether it did."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime <= seconds:  # lstat: a link is no dir
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def _check_mine(fd: int, path: str) -> None:
    """PermissionError unless path is a directory of this user's that only it may write,
    and fd its lock file, also this user's: in a directory anyone may write to (/dev/shm)
    another user could make one under the name first, and plant links or a held lock."""
    euid = os.geteuid()
    d, f = os.lstat(path), os.fstat(fd)
    if not stat.S_ISDIR(d.st_mode) or d.st_uid != euid or d.st_mode & 0o022 or f.st_uid != euid:
        raise PermissionError(errno.EACCES, f"{path} is not a directory of this user's (uid {euid}) that only it "
                                            f"may write to: not used")


def same_file(fd: int, path: str) -> bool:
    """Whether fd is the file at path now."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
