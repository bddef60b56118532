"""Deletes a RocksDB write stop kept off the disk, recorded outside RocksDB (DATA_DIR/owed-deletes).

An entry evicted while writes are stopped is a miss at once, its delete left for once writes go
again (Store._delete_soon: stranded). A restart before that found its records whole and indexed it
again: a chunk the manager had evicted came back until its next reconcile evicted it again. The
write stop refuses RocksDB's writes, not a plain file's: each stranded delete is appended here as
(id, bound), bound being the store's next sequence number then, and a start deletes the records of
an id whose sequence is below its bound (a put of the id since has a higher one, and is kept).

Record: u16 id length, id, u64 bound (little-endian). Appended with one write each batch; a torn
last record (a crash mid-write) is ignored. The file is emptied once nothing is stranded. Written
without fsync but under durability "power" (it survives a kill -9 as the page cache does); a write
that fails (a full disk) is logged, and that restart indexes those entries again, as before.
"""
from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable

log = logging.getLogger("cacheserver")

OWED_FILE = "owed-deletes"
_LEN, _BOUND = struct.Struct("<H"), struct.Struct("<Q")


class OwedDeletes:
    """The owed-deletes file of one data dir (used under the store's lock, or before serving)."""

    def __init__(self, data_dir: str, sync: bool = False) -> None:
        self.path = os.path.join(data_dir, OWED_FILE)
        self.sync = sync
        self.empty = not os.path.exists(self.path) or os.path.getsize(self.path) == 0

    def load(self) -> dict[bytes, int]:
        """id -> the highest bound recorded for it; {} without a file. A torn tail is ignored."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return {}
        out: dict[bytes, int] = {}
        pos = 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            end = pos + _LEN.size + n + _BOUND.size
            if end > len(data):
                break  # torn: the crash came mid-write, before the delete could have been owed for long
            key = data[pos + _LEN.size:pos + _LEN.size + n]
            out[key] = max(out.get(key, 0), _BOUND.unpack_from(data, end - _BOUND.size)[0])
            pos = end
        return out

    def record(self, owed: Iterable[tuple[bytes, int]]) -> None:
        """Append (id, bound) pairs; never raises (the deletes stay owed in memory all the same)."""
        data = b"".join(_LEN.pack(len(k)) + k + _BOUND.pack(b) for k, b in owed)
        if not data:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.empty = False
        except OSError as e:
            log.warning("could not record deletes a write stop left (%s): a restart before writes go "
                        "again indexes those entries again", e)

    def clear(self) -> None:
        """Nothing is owed any more: empty the file (a failure leaves records a start finds done)."""
        if self.empty:
            return
        try:
            os.truncate(self.path, 0)
            self.empty = True
        except FileNotFoundError:
            self.empty = True
        except OSError as e:
            log.warning("could not empty %s: %s", self.path, e)
