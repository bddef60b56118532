"""Room on the store's file system, apart from --capacity.

RocksDB that fails a flush for lack of space stays failed until it is
closed, and the values it held only in its memtable (durability "cache")
are lost. So a put is accepted only while the file system can take it plus
everything still unflushed, and the store keeps a reserve file that it
deletes when a flush would otherwise not fit (something else filled the
disk since the put was accepted). While there is no room, puts are refused
(`rejected_disk_full`; one clear log line when it starts and when it ends)
and reads go on. States: ``ok`` -> ``full`` (no room: puts refused) ->
``ok`` once room is back; ``failed`` (a write failed: RocksDB is read-only
until restart) is final for the process."""
from __future__ import annotations

import logging
import os
import shutil

from .sizes import format_size

log = logging.getLogger("cacheserver")
RESERVE_NAME = "reserve"
MARGIN = 1 << 20  # the log and MANIFEST appends of a flush


def reserve_size(capacity: int) -> int:
    # Past half of it a flush starts: at 256 MiB that is past the 64 MiB memtable, so large
    # stores flush no more often than RocksDB would by itself (tools/bench/revpath).
    return min(256 << 20, max(2 << 20, capacity // 16))


class DiskRoom:
    def __init__(self, data_dir: str, capacity: int) -> None:
        self.data_dir = data_dir
        self.reserve_path = os.path.join(data_dir, RESERVE_NAME)
        self.reserve = reserve_size(capacity)
        self.state = "ok"
        self._why = ""
        self._released = False  # before_flush gave the reserve up: made again once there is room
        self.ensure_reserve()

    def free(self) -> int:
        return shutil.disk_usage(self.data_dir).free

    def ensure_reserve(self) -> None:
        """Create the reserve file when there is room for it (at start, when room is back, and after
        a flush gave it up: before_flush)."""
        if os.path.exists(self.reserve_path):
            self._released = False
            return
        if self.free() < self.reserve + MARGIN:
            return
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.reserve)
            finally:
                os.close(fd)
            self._released = False
        except OSError as e:
            log.warning("cannot create the disk reserve %s: %s", self.reserve_path, e)
            try:
                os.unlink(self.reserve_path)
            except OSError:
                pass

    def put_problem(self, need: int, unflushed: int) -> str | None:
        """Why a put of ``need`` bytes cannot be accepted now, or None."""
        if self.state == "failed":
            return self._why
        free = self.free()
        if free >= need + unflushed + MARGIN:
            if self.state == "full":
                self.state = "ok"
                log.info("disk has room again (%s free): puts are accepted", format_size(free))
                self.ensure_reserve()
            elif self._released and free >= need + unflushed + MARGIN + self.reserve:
                # given up for a flush while puts went on: without it the next disk that
                # something else fills fails a flush, and RocksDB stays read-only
                self.ensure_reserve()
            return None
        why = (f"disk full: {format_size(free)} free on the file system of {self.data_dir}, a put needs "
               f"{format_size(need + unflushed + MARGIN)} (with what is not flushed yet); puts are refused "
               "and reads go on until space is freed")
        if self.state == "ok":
            log.error("%s", why)
        self.state, self._why = "full", why
        return why

    def before_flush(self, unflushed: int) -> None:
        """Give up the reserve if the flush of ``unflushed`` bytes would not fit without it."""
        if self.free() >= unflushed + MARGIN or not os.path.exists(self.reserve_path):
            return
        os.unlink(self.reserve_path)
        self._released = True
        log.warning("disk nearly full: released the %s reserve so that acknowledged puts can be flushed",
                    format_size(self.reserve))

    def write_failed(self, err: BaseException) -> None:
        """RocksDB failed a write: it refuses every write from now on."""
        self._why = (f"the store failed a write ({' '.join(str(err).split())}); puts are refused and reads "
                     "go on until the server is restarted (with room on the disk)")
        if self.state != "failed":
            log.error("%s", self._why)
        self.state = "failed"
