"""How many store reads one process runs at once (CachedDataset's `fetch_threads`).

Reads from a local disk cost CPU rather than waiting: from the page cache a read
is a copy, and every open, read and hash hands the GIL back and forth, so threads
beyond the cores only contend for it. Measured on 2 cores (calls made
directly, docs/benchmarks.md): a filling epoch cost 1.6-2.0 core-s per GB with
16 threads and 1.3-1.55 with 4, and 4 were also the fastest from a cold disk.
Network and FUSE mounts (NFS, gcsfuse, s3fs, ...) wait on the network for each
read, as fsspec's remote stores do, so they keep every thread asked for; so does
a filesystem whose type is not known to be local.
"""
from __future__ import annotations

import os
from typing import Any

from preprocess.workerctl import max_workers

PER_CORE = 2  # reads in flight per core on a local disk: one copying or hashing, one waiting on the disk
# /proc/self/mounts types of local block devices and memory; anything else may wait on a network
LOCAL_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs", "nilfs2",
    "vfat", "exfat", "ntfs3", "fuseblk", "hfsplus", "apfs", "tmpfs", "ramfs", "overlay", "squashfs", "erofs",
    "iso9660", "udf",
})


def store_read_threads(fs: Any, root: str, wanted: int, *, mounts: str | None = None,
                       cores: int | None = None) -> int:
    """Reads to run at once for a store at `root` on fsspec filesystem `fs`: `wanted` (at
    least 1), capped at PER_CORE per core where the store is a local disk."""
    wanted = max(1, wanted)
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return wanted  # remote stores wait on the network (async ones batch in one cat_ranges call)
    if mounts is None:
        try:
            # surrogateescape: a mount point that is not UTF-8 compares equal to os.path.realpath's
            with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
                mounts = f.read()
        except OSError:  # not Linux: the type is unknown
            return wanted
    fstype = mount_type(os.path.realpath(fs._strip_protocol(root)), mounts)
    if fstype not in LOCAL_TYPES:
        return wanted
    return min(wanted, PER_CORE * (cores or max_workers()))  # max_workers: the cores this process may use


def mount_type(path: str, mounts: str) -> str | None:
    """The filesystem type of the mount holding absolute `path`, from the text of
    /proc/self/mounts (the last mount of the longest matching mount point wins, as
    the kernel stacks them); None if no line matches. A later mount over a parent of
    an earlier one hides it but is not noticed here (the cost: a pool capped or not)."""
    best, best_len = None, -1
    for line in mounts.split("\n"):  # not splitlines(): the kernel leaves \x0b, \x0c, U+2028 ... unescaped
        fields = line.split(" ")  # single spaces: fields escape their own whitespace, not \x0b or \x0c
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = fields[2], len(point)
    return best


def _unescape(field: str) -> str:
    """A mount point as the kernel writes it: space, tab, newline and backslash as octal escapes."""
    if "\\" not in field:
        return field
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
