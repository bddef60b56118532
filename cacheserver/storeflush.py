"""A store's flushes and its close (Store's part): memtables written to table files
(with durability "cache" this is what makes values safe from a crash: flusher.py), the
follower-friendly flush, and a close that ends the flushes under way, including one
RocksDB holds for a write stop that nothing ends (stallwrite.py).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("cacheserver")
FOLLOWER_FLUSH_MIN_BYTES = 4 << 20  # smaller logs replay in ~10 ms: not worth a flush
CLOSE_FLUSH_WAIT_S = 30.0  # a close waits this long at most for a flush RocksDB holds for a write stop


def rocksdb_error(err: BaseException) -> bool:
    """An error of RocksDB's own (an I/O error, corruption): rocksdict raises those as bare
    Exceptions. After one RocksDB refuses every write until it is reopened; anything else
    (MemoryError, a bad value, WriteStopped, a closed store) says nothing about the store."""
    return type(err) is Exception


class Flushes:
    """Mixed into Store (store.py): the attributes and methods used here are the Store's."""
    _db: Any
    _lock: Any
    progress: Any
    closing: bool
    _state_owed: dict[str, bytes]  # server state a write stop kept off the disk (storerecovery.py)

    def _dirty_state(self) -> tuple[float | None, float, float]:
        with self._lock:
            return self._dirty_since, self._last_write, self._last_unflushed_read

    def flush(self) -> bool:
        """Write the memtables to table files; with durability "cache" this makes
        every value written before the call safe from a crash. None once closing
        begins (but close's own), and none RocksDB would hold for a write stop
        that nothing ends (stallwrite.py: it would wait there for ever). Returns
        whether it flushed; a failure is recorded (logged, a RocksDB error fails
        the store), not raised, and the flusher tries again where that may help."""
        return self._flush(final=False)

    def _flush(self, final: bool) -> bool:
        if self.progress.stuck() is not None:
            return False
        if self._stranded:
            self._drop_stranded()
        if self._state_owed:  # server state a write stop kept off the disk (Recovery.keep_state)
            try:
                self._pay_state()
            except Exception as e:  # stopped again: owed still; RocksDB's own error fails the store
                self._put_failed(e)
        with self._lock:
            if self.closing and not final:
                return False
            # values from the mark on may not be written yet: those of puts under way, and the
            # index records of puts a write stop ended (their ids not deleted yet)
            mark = min((*self._writing, *self._stranded.values()), default=self._seq)
            dirty, self._dirty_since = self._dirty_since, None  # a write from here on marks it again
            self._flushing += 1
        flushed, again = False, True
        try:
            flushed, again = self._flush_files(mark)
        finally:
            with self._lock:
                self._flushing -= 1
                if again and dirty is not None:  # still unflushed: the flusher tries again
                    self._dirty_since = min(dirty, self._dirty_since or dirty)
        return flushed

    def _flush_files(self, mark: int) -> tuple[bool, bool]:
        """(whether it flushed, whether a later flush may do what this one could not: False
        where all was done, or RocksDB failed and refuses every write until reopened)."""
        try:
            self.room.before_flush(self._unflushed_bytes())
        except OSError as e:  # the reserve could not be given up: the flush would not fit either
            self._flush_failed(f"making room for it: {e!r}")
            return False, True
        try:
            self._db.flush()
            self._large.flush()
            self._meta.flush()
            self._server.flush()
        except Exception as e:
            if rocksdb_error(e):  # it stays read-only now
                self.room.write_failed(e)
                return False, False
            self._flush_failed(repr(e))  # not the store's: the next flush tries again
            return False, True
        if self._failing:
            self._failing = False
            log.warning("flushing the store works again")
        self.counters.add("flushes")
        if self.durability != "cache":
            return True, False
        with self._lock:  # in table files now, whether or not their mark below is written
            self._unflushed = {k: s for k, s in self._unflushed.items() if s >= mark}
        return True, self._write_mark(mark)

    def _write_mark(self, mark: int) -> bool:
        """Write the durable mark of a flush made; returns whether a later flush should (a write
        stop kept it off the disk; not after RocksDB's own error, which fails the store). Nothing
        is lost without it: the values are in table files, and a restart checks those from the
        older mark on (_recover_unflushed). Raised, it went out of close() before RocksDB and
        the data dir were released, and out of OPEN_FOLLOWER as an internal error."""
        try:
            self._flushed_mark(mark)
            return False
        except Exception as e:
            if rocksdb_error(e):  # the store fails, as at a put's error: no later flush writes it
                self.room.write_failed(e)
                return False
            self._flush_failed(f"writing its durable mark: {e!r}")
            return True

    _failing = False  # the last flush failed, not for RocksDB's own error (said once)

    def _flush_failed(self, why: str) -> None:
        """Said once, not at each of the flusher's retries (every CHECK_S while it lasts)."""
        if not self._failing:
            self._failing = True
            log.warning("flushing the store failed (%s); tried again until it works", why)

    def _drop_stranded(self) -> None:
        """Delete what is left on disk of the ids of puts a write stop ended (put_many): an
        index record without its value, or a replaced value, that a restart would index, or
        keep unaccounted. Ids put again since are held as put; ids being put wait."""
        with self._lock:
            stranded = self._stranded
            gone = [k for k in stranded if k not in self._index and k not in self._pending]
            try:
                if gone:
                    self._delete_keys(gone)
            except Exception:  # stopped again, or a failed store (the flush records it): kept for later
                return
            for k in [k for k in stranded if k in self._index] + gone:
                del stranded[k]

    def flush_for_followers(self, min_bytes: int = FOLLOWER_FLUSH_MIN_BYTES) -> bool:
        """Flush the memtables (every column family, so the log can go) if they
        hold at least `min_bytes`. A follower that opens replays the live log
        (~3 ms/MB measured) and so does every other one; one flush (~2 ms/MB)
        makes each open ~5 ms instead. Returns whether it flushed: not when the flush was
        skipped (a write stop, closing) or failed (core.open_follower backs off only after one)."""
        if self._unflushed_bytes() < min_bytes:
            return False
        return self.flush()

    def _end_flushes(self, timeout: float = CLOSE_FLUSH_WAIT_S) -> bool:
        """Wait for the flushes under way (none starts: closing); one that RocksDB holds for a
        write stop that nothing ends (stallwrite.py), or past ``timeout``, is cancelled with
        RocksDB's background work, which ends the store's writes. Returns whether it was."""
        deadline = time.monotonic() + timeout
        while self._flushing:
            why = self.progress.stuck()
            if why is not None or time.monotonic() >= deadline:
                log.warning("closing the store while RocksDB holds a flush for a write stop (%s); values not "
                            "yet flushed are refetched as misses after restart", why or "it lasted too long")
                self._db.cancel_all_background(True)
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Flush, then release RocksDB (its LOCK) and the data dir, also after a failed write:
        the embedded cache retries by reopening the same dir in this process. RocksDB's error
        is raised only where nothing failed before (then it is news), once both are released."""
        with self._lock:
            self.closing = True  # no flush starts from here on but the last one below
        cancelled = False
        try:
            cancelled = self._end_flushes()
            if self._flusher is not None:
                self._flusher.stop()
            self.admit.stop()  # a background flush (diskadmit.py) ends first, none starts later
            if not cancelled:
                self._flush(final=True)
        finally:  # whatever went wrong above: a lock kept here stays kept for the process's life
            try:
                errors = self._release_db()
            finally:
                os.close(self._dir_lock)
        if not errors:
            return
        if self.room.state != "failed" and not cancelled:
            raise errors[0]
        log.error("closing the store after a failed or cancelled write (%s): RocksDB is released; %s",
                  " ".join(str(errors[0]).split()), self._lost())

    def _release_db(self) -> list[Exception]:
        """Close the column families' views, drop their handles, then close RocksDB; returns the
        errors of their last flushes. Each close lets go of its reference even where its flush
        fails (a failed store's does), and RocksDB closes with the last: one left behind (the
        loop ended by a raise) kept RocksDB and its LOCK in this process for good."""
        errors: list[Exception] = []
        views = [self.__dict__.pop(name, None) for name in ("_meta", "_server", "_large")]
        for name in ("_meta_cf", "_server_cf", "_large_cf"):
            self.__dict__.pop(name, None)  # they hold RocksDB too
        for view in (*views, self.__dict__.get("_db")):  # the views share its handle: it goes last
            try:
                if view is not None:
                    view.close()
            except Exception as e:  # RocksDB's errors are bare Exceptions
                errors.append(e)
        return errors

    def _lost(self) -> str:
        """What a close after a failed write lost: with durability "cache" the values no flush
        reached (their index records, logged, are dropped at restart: _recover_unflushed)."""
        if self.durability != "cache":
            return "nothing acknowledged is lost (every put went through the log)"
        n = len(self._unflushed)
        if not n:
            return "nothing acknowledged is lost (every value was flushed)"
        return (f"up to {n} values put since the last flush are lost: they are misses after restart, "
                "refetched as any")
