"""One store per data dir: an flock held for as long as the store is open."""
from __future__ import annotations

import fcntl
import os


class DataDirBusy(RuntimeError):
    """Another store, in this process or another, has the data dir open."""


def lock_dir(path: str) -> int:
    """Hold the data dir (flock on DIR/store.lock) for as long as the store is open."""
    fd = os.open(os.path.join(path, "store.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirBusy(f"data dir {path} is in use by another cache server") from None
    return fd
