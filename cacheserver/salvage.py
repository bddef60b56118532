"""Opening the RocksDB store when its files may be damaged.

A damaged table file (truncated, overwritten) makes RocksDB refuse to open.
The daemon then stops with one line naming the file and the choices; with
``--salvage`` it runs RocksDB's repair, which keeps every record it can read
and moves unreadable files to ``db/lost/``, removes those, and the store then
drops index entries whose value is gone (Store._recover with a full check).
A lost CURRENT counts as damage too: RocksDB would start a new, empty store
over the files (current_lost). A cache loses nothing it cannot refetch."""
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
        if not salvage:
            raise StoreDamaged(damage_message(db_path, e)) from None
        log.warning("store damaged (%s); salvaging what is readable", " ".join(str(e).split()))
    rocksdict.Rdict.repair(db_path, opts)
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
