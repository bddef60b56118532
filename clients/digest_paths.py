"""Entry paths of a digest must stay under its root.

A digest's path is joined to the root to read an item; a path that is
absolute or has a ``..`` component would read a file outside the dataset
(and, its hash matching or hashing off, feed it to training and the shared
cache).  Such entries are refused when a digest is made and when it is
loaded, by the same check (docs/security.md).
"""

from __future__ import annotations

import re
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


def url_quoted(fs: Any) -> bool:
    """Whether fsspec filesystem ``fs`` names files by URL (http, https), so that a digest's
    entry (the file's name, as local, gs:// and s3:// digests record it) must be quoted."""
    protocol = getattr(fs, "protocol", ())
    return "http" in ((protocol,) if isinstance(protocol, str) else protocol)


def store_path(base: str, rel: str, quoted: bool = False) -> str:
    """The path fsspec opens for entry ``rel`` under ``base`` (quoted: see url_quoted):
    'a b.jpg' is 'a%20b.jpg' and 'c#1.jpg' 'c%231.jpg' in a URL."""
    return f"{base.rstrip('/')}/{quote(rel, safe='/') if quoted else rel}"
