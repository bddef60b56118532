"""Entry paths of a digest must stay under its root.

A digest's path is joined to the root to read an item; a path that is
absolute or has a ``..`` component would read a file outside the dataset
(and, its hash matching or hashing off, feed it to training and the shared
cache).  Such entries are refused when a digest is made and when it is
loaded, by the same check (docs/security.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np

_DOTDOT = re.compile(rb"\.\.")


def path_problem(path: str) -> str | None:
    """Why ``path`` may not be a digest entry, or None when it may."""
    if path.startswith("/") or path.startswith("\\"):
        return "is absolute"
    if ".." in path.replace("\\", "/").split("/"):
        return "has a '..' component"
    return None


def bad_path(strings: memoryview, offsets: np.ndarray) -> tuple[int, str, str] | None:
    """(entry, path, why) of the first path-table entry that escapes the root.

    Works on the packed table without decoding every path: absolute paths by
    their first byte, ``..`` by a scan of the bytes for the rare candidates."""
    npaths = len(offsets) - 1
    if npaths <= 0:
        return None
    blob = np.frombuffer(strings, np.uint8)
    starts = np.asarray(offsets[:-1], np.int64)
    nonempty = np.asarray(offsets[1:], np.int64) > starts
    first = np.zeros(npaths, np.uint8)
    first[nonempty] = blob[starts[nonempty]]
    suspects = set(np.flatnonzero((first == ord("/")) | (first == ord("\\"))).tolist())
    for m in _DOTDOT.finditer(strings):
        suspects.add(int(np.searchsorted(offsets, m.start(), side="right")) - 1)
    for j in sorted(suspects):
        path = bytes(strings[int(offsets[j]):int(offsets[j + 1])]).decode("utf-8", "replace")
        why = path_problem(path)
        if why:
            return j, path, why
    return None


# The meta 'tool' of digests that hold an HTTP listing's names as listed (percent-encoded):
# tools/digest recorded them so until it recorded the files' names.
LISTED_NAMES_TOOL = "mlcache tools/digest 1"


def listed_names(meta: Mapping[str, str] | None) -> bool:
    """Whether a digest with creation metadata ``meta`` holds an HTTP store's entries as
    its listing spelled them, quoted already: read as they are, not quoted again."""
    return meta is not None and meta.get("tool") == LISTED_NAMES_TOOL


def url_quoted(fs: Any, digest: Any = None) -> bool:
    """Whether fsspec filesystem ``fs`` names files by URL (http, https), so that an entry
    of ``digest`` (the file's name, as local, gs:// and s3:// digests record it) must be
    quoted: all but listed_names digests'."""
    protocol = getattr(fs, "protocol", ())
    if "http" not in ((protocol,) if isinstance(protocol, str) else protocol):
        return False
    return digest is None or not listed_names(digest.meta)  # meta: a copy, made only here


def store_path(base: str, rel: str, quoted: bool = False) -> str:
    """The path fsspec opens for entry ``rel`` under ``base`` (quoted: see url_quoted):
    'a b.jpg' is 'a%20b.jpg' and 'c#1.jpg' 'c%231.jpg' in a URL."""
    return f"{base.rstrip('/')}/{quote(rel, safe='/') if quoted else rel}"
