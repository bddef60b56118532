"""Opening the RocksDB store when its files may be damaged.

A damaged table file (truncated, overwritten) makes RocksDB refuse to open.
The daemon then stops with one line naming the file and the choices; with
``--salvage`` it runs RocksDB's repair, which keeps every record it can read
and moves unreadable files to ``db/lost/``, removes those, and the store then
drops index entries whose value is gone (Store._recover with a full check).
A lost CURRENT counts as damage too: RocksDB would start a new, empty store
over the files (current_lost). A cache loses nothing it cannot refetch. An open that fails
for the machine's reasons (permissions, a full or read-only disk) is no damage: it is named
as such, and --salvage does not repair then (StoreUnopenable)."""
from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping

import rocksdict

log = logging.getLogger("cacheserver")
_FILE = re.compile(r"(/\S+?\.(?:sst|log|blob)|MANIFEST-\d+|CURRENT)\b")


class StoreDamaged(ValueError):
    """The store's files cannot be opened; the message says what to do."""


class StoreUnopenable(ValueError):
    """The store cannot be opened for a reason of the machine's (permissions, a full or read-only
    disk), not damage: --salvage would not help, and its repair could drop readable files."""


# RocksDB's (or the OS's) words for failures that are not damage, and what to do about each
_NOT_DAMAGE = {
    "Permission denied": "give this user read and write access to the data dir and all its files, or run "
                         "the server as the user that owns them",
    "No space left on device": "free space on its file system",
    "Read-only file system": "give it a writable data dir",
    "Too many open files": "raise this process's open-file limit (ulimit -n)",
    "While lock file": "another process has this store open (RocksDB's LOCK in its db dir): stop that one first",
    "lock hold by current process": "this process has this store open already (an earlier open not closed): "
                                    "close that one first",
}


def machine_problem(db_path: str, err: BaseException) -> str | None:
    """One line for an open that failed for a reason that is not damage, or None."""
    text = " ".join(str(err).split())
    for words, fix in _NOT_DAMAGE.items():
        if words in text:
            data_dir = os.path.dirname(db_path)
            who = denied(data_dir) if words == "Permission denied" else ""
            return (f"the store in {data_dir} cannot be opened ({text}){who}: {fix}. Its files are not "
                    "damaged: --salvage would not help")
    return None


def denied(data_dir: str) -> str:
    """The first file of the data dir (and its db dir) that this user may not read and write, and its owner."""
    names = [data_dir, os.path.join(data_dir, "db")]
    for d in list(names):
        try:
            names += sorted(os.path.join(d, n) for n in os.listdir(d))
        except OSError:
            pass  # unreadable itself: found below
    for path in names:
        mode = os.R_OK | os.W_OK | (os.X_OK if os.path.isdir(path) else 0)
        if os.path.exists(path) and not os.access(path, mode):
            return f"; {path} belongs to uid {os.stat(path).st_uid}, this server runs as uid {os.geteuid()}"
    return ""


def damage_message(db_path: str, err: BaseException) -> str:
    """One line: the damaged file RocksDB names, and the operator's choices."""
    text = " ".join(str(err).split())
    m = _FILE.search(text)
    named = f"file {m.group(1)}" if m else f"a file under {db_path}"
    data_dir = os.path.dirname(db_path)
    return (f"the store is damaged: {named} cannot be read ({text}). Choices: restart with --salvage to "
            f"keep what is readable and drop the rest (a cache refetches it), or move {data_dir} away "
            "to start empty, or restore it from a copy")


def current_lost(db_path: str) -> bool:
    """CURRENT, which names the MANIFEST, is gone while the store's files remain. RocksDB
    would take the dir for a new store (create_if_missing): start empty and delete those
    files, or refuse over a log file after writing a new, empty MANIFEST, so that a
    restart, even with --salvage, started empty all the same."""
    if os.path.exists(os.path.join(db_path, "CURRENT")):
        return False
    try:
        names = os.listdir(db_path)
    except FileNotFoundError:
        return False
    return any(n.endswith((".sst", ".blob", ".log")) or n.startswith("MANIFEST-") for n in names)


def open_db(db_path: str, opts: rocksdict.Options, cfs: Mapping[str, rocksdict.Options],
            salvage: bool) -> tuple[rocksdict.Rdict, bool]:
    """(the open store, whether it was repaired). Raises StoreDamaged when
    it cannot be opened and ``salvage`` is off."""
    try:
        if current_lost(db_path):  # not opened at all: that would drop what salvage can keep
            raise OSError(f"CURRENT is missing in {db_path}, which holds the store's files")
        return rocksdict.Rdict(db_path, opts, column_families=dict(cfs)), False
    except Exception as e:  # rocksdict raises a bare Exception for RocksDB errors
        problem = machine_problem(db_path, e)
        if problem:
            raise StoreUnopenable(problem) from None
        if not salvage:
            raise StoreDamaged(damage_message(db_path, e)) from None
        log.warning("store damaged (%s); salvaging what is readable", " ".join(str(e).split()))
    try:
        rocksdict.Rdict.repair(db_path, opts)
    except Exception as e:
        raise StoreUnopenable(machine_problem(db_path, e) or f"the store could not be salvaged "
                              f"({' '.join(str(e).split())}); move {os.path.dirname(db_path)} away to start empty") from None
    lost = os.path.join(db_path, "lost")
    if os.path.isdir(lost):
        dropped = sorted(os.listdir(lost))
        shutil.rmtree(lost)  # unreadable: keeping them would only hold disk space
        log.warning("salvage dropped unreadable store files: %s", ", ".join(dropped) or "none")
    try:
        return rocksdict.Rdict(db_path, opts, column_families=dict(cfs)), True
    except Exception as e:
        raise StoreDamaged(f"the store could not be salvaged ({' '.join(str(e).split())}); "
                           f"move {os.path.dirname(db_path)} away to start empty") from None
