"""One store per data dir (an flock held for as long as the store is open), and
the dir's record format: sealed (the default) or plain (an embedded cache's own)."""
from __future__ import annotations

import fcntl
import os

RECORDS_FILE = "records"  # DATA_DIR/records: "plain" for a dir of plaintext records
PLAIN = "plain"


class DataDirBusy(RuntimeError):
    """Another store, in this process or another, has the data dir open."""


class PlaintextDir(ValueError):
    """A data dir's record format is not the one it was opened for."""


def make_dir(path: str) -> None:
    """Create the data dir; NotADirectoryError naming the file in the way (the OS says only
    "File exists" for the dir itself)."""
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        probe = os.path.abspath(path)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        raise NotADirectoryError(f"data dir {path} cannot be a directory: {probe} is a file") from None


def lock_dir(path: str) -> int:
    """Hold the data dir (flock on DIR/store.lock) for as long as the store is open."""
    lock = os.path.join(path, "store.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except PermissionError:
        owner = os.stat(lock if os.path.exists(lock) else path).st_uid
        raise PermissionError(f"data dir {path}: this server (uid {os.geteuid()}) may not open {lock} for "
                              f"writing; it belongs to uid {owner}: run the server as that user, or give it "
                              "another data dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirBusy(f"data dir {path} is in use by another cache server") from None
    return fd


def records_format(path: str) -> str | None:
    """"plain" for a dir marked so, "sealed" for one holding a store without the mark,
    None for a dir with no store yet (either may start there)."""
    try:
        with open(os.path.join(path, RECORDS_FILE)) as f:
            mark = f.read().strip()
    except FileNotFoundError:
        return "sealed" if os.path.isdir(os.path.join(path, "db")) else None
    if mark != PLAIN:
        raise PlaintextDir(f"data dir {path}: unknown record format {mark!r} in {RECORDS_FILE}")
    return PLAIN


def claim_records(path: str, plain: bool) -> None:
    """Check the dir holds records of the format asked for (marking a new dir plain
    before its store is made); PlaintextDir naming both otherwise."""
    found = records_format(path)
    if plain and found == "sealed":
        raise PlaintextDir(f"data dir {path} holds sealed (encrypted) records; plaintext records "
                           f"need a new dir")
    if not plain and found == PLAIN:
        raise PlaintextDir(
            f"data dir {path} holds an embedded cache's plaintext records ({RECORDS_FILE}: {PLAIN}); a "
            f"cache server serves only sealed records: give it another --data-dir, or delete this one")
    if plain and found is None:
        check_owner(path)
        os.chmod(path, 0o700)  # its owner's items in the clear: nobody else may look
        tmp = os.path.join(path, RECORDS_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(PLAIN + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, RECORDS_FILE))
    if plain:
        check_private(path)


def check_owner(path: str) -> None:
    """PlaintextDir unless the dir belongs to this user."""
    uid = os.stat(path).st_uid
    if uid != os.geteuid():
        raise PlaintextDir(f"data dir {path} is for plaintext records but belongs to uid {uid}, not "
                           f"this user (uid {os.geteuid()}): use a cache dir of your own")


def check_private(path: str) -> None:
    """A plain dir's values are trusted as its writers checked them (docs/security.md):
    it must be this user's and shut to everyone else; PlaintextDir saying how otherwise.
    Once open to others, anything in it may have been planted: it is a cache, so the
    remedy is a new one (a parent dir that others can write is the user's to avoid)."""
    check_owner(path)
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise PlaintextDir(f"data dir {path} holds plaintext records but is open to others (mode "
                           f"{mode:o}): what is in it may not be this user's; delete it (it is a cache, "
                           f"made again on first use, private) or give another cache dir")
