"""Datasets of small files for tests: the files and their digest."""
import hashlib
import os
from collections.abc import Iterable

from clients.digest import DigestBuilder


def write_files_digest(root, blobs: Iterable[bytes]) -> str:
    """One file per blob under `root` (named 00000, 00001, ...); returns the digest path."""
    os.makedirs(root, exist_ok=True)
    b = DigestBuilder(str(root), "files")
    for i, data in enumerate(blobs):
        with open(os.path.join(root, f"{i:05d}"), "wb") as f:
            f.write(data)
        b.add(hashlib.sha256(data).digest(), len(data), f"{i:05d}")
    path = str(root) + ".digest"
    b.build().save(path)
    return path
