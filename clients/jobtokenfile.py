"""A lone training process's job token, kept in a user-private file (docs/security.md, Job tokens).

The first RegisterJob of a job name fixes its token, and the manager keeps the
job until --job-timeout-seconds pass without contact. A process that no launcher
gave a shared secret (no MLCACHE_JOB_SECRET, not under torchrun) would otherwise
hold its token only in memory: restarted after a crash under the same job name,
it would be refused. So it makes its token before registering, keeps it in
``<cache dir>/jobs/<hash of the manager address>/<job>.token`` (mode 0600, in
0700 directories; the cache dir is $MLCACHE_DIR, else $XDG_CACHE_HOME/mlcache,
else ~/.cache/mlcache; $MLCACHE_JOB_TOKEN_DIR replaces <cache dir>/jobs) and
presents it again on the next run of that job name with that manager. The file is as private as the user's home: whoever can read it
can act as the job, which is also true of the user's environment.

While a process runs the job it holds an exclusive flock on the file, so a
second live process of the same user and job name does not take the token (it is
refused, as before); the kernel drops the lock of a killed process.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from urllib.parse import quote

from cacheserver.roles import check_printable
from manager import jobtokens

log = logging.getLogger("mlcache.client")
DIR_ENV = "MLCACHE_JOB_TOKEN_DIR"
_MAX_NAME = 120  # longer job names are hashed into the file name


def token_dir(manager: str, env: Mapping[str, str] = os.environ) -> str:
    """The directory of this user's job tokens for the manager at ``manager``: under
    $MLCACHE_JOB_TOKEN_DIR, else <cache dir>/jobs."""
    base = env.get(DIR_ENV) or os.path.join(env.get("MLCACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlcache"), "jobs")
    return os.path.join(base, hashlib.sha256(manager.encode()).hexdigest()[:16])


def _file_name(job: str) -> str:
    name = quote(job, safe="-_.")
    if len(name) > _MAX_NAME:
        name = hashlib.sha256(job.encode()).hexdigest()
    return name + ".token"


class JobTokenFile:
    """This user's token for one job name with one manager; ``claim`` it before registering."""

    def __init__(self, manager: str, job: str, directory: str | None = None) -> None:
        self.directory = directory or token_dir(manager)
        self.path = os.path.join(self.directory, _file_name(job))
        self.why_none = ""  # why claim() gave no token
        self._fd: int | None = None

    def claim(self) -> str | None:
        """The token to register with (the kept one, else a new one, kept now), or None
        (``why_none`` says why: another live process of this user holds the job's file, or
        the file cannot be written: the process then registers as before, without one).
        ValueError (naming the file) when it is not private or not a token."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:  # e.g. a read-only home in a container
            self.why_none = f"its job token file {self.path} cannot be kept ({e.strerror or e})"
            log.warning("job token not kept across restarts: %s", self.why_none)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.why_none = f"another running process of this user holds the job's token file {self.path}"
                return None
            token = self._read_or_make(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return token

    def _read_or_make(self, fd: int) -> str:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"job token file {self.path}: readable by others or not yours; it lets its "
                             f"reader act as the job: remove it, or chown it to you and chmod 600 it")
        data = os.read(fd, 4096).strip()
        if data:
            check_printable(data, f"job token file {self.path}")
            return data.decode()
        token = jobtokens.new_token()
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
        return token

    def release(self) -> None:
        """Let another process of this user take the job's token (the file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
