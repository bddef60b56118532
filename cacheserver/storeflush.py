"""A store's flushes and its close (Store's part): memtables written to table files
(with durability "cache" this is what makes values safe from a crash: flusher.py), the
follower-friendly flush, and a close that ends the flushes and writes under way, including
those that wait out a write stop that nothing ends (stallwrite.py), before it releases RocksDB.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import rocksdict

from .diskbudget import BLOB_MIN
from .stallwrite import STOPPED, Progress, Writes, WriteStopped

log = logging.getLogger("cacheserver")
FOLLOWER_FLUSH_MIN_BYTES = 4 << 20  # smaller logs replay in ~10 ms: not worth a flush
CLOSE_FLUSH_WAIT_S = 30.0  # a close waits this long at most for a flush under way (its first steps too) through a write stop
GIVEN_UP_WAIT_S = 5.0  # ...and this long for flushes and writes it gave up on (each ends at its next try)
POLL_S = 0.05


class WriteGate:
    """What a close waits for before it releases RocksDB: the flushes under way (from the flusher,
    puts, requests) and the writes under way (GatedWrites). A writer left running wrote to a
    closed store. Its lock is never held across RocksDB calls, unlike the store's."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._flushes = self._writes = 0
        self.closing = False  # no flush starts but close's own
        self._shut = False  # no write starts, and one waiting out a write stop gives up

    def begin_flush(self, final: bool) -> bool:
        with self._cond:
            if self.closing and not final:
                return False
            self._flushes += 1
            return True

    def end_flush(self) -> None:
        with self._cond:
            self._flushes -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closing = True

    def flushes_done(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._flushes == 0, timeout)

    def check(self) -> None:
        if self._shut:
            raise WriteStopped("the store closes: a write under way was given up")

    def enter(self) -> None:
        with self._cond:
            self.check()
            self._writes += 1

    def leave(self) -> None:
        with self._cond:
            self._writes -= 1
            self._cond.notify_all()

    def shut(self, timeout: float = 0.0) -> bool:
        """No write starts from here on, and those under way give up; returns whether they ended."""
        with self._cond:
            self._shut = True
            return self._cond.wait_for(lambda: self._writes == 0, timeout)


class GatedWrites(Writes):
    """stallwrite.Writes counted by the store's WriteGate. A write waiting out a write stop builds
    its batch again at each try: once the gate shuts, that build raises WriteStopped, so a close
    waits one poll for it, not STUCK_S (or for ever, for a stop RocksDB's work would end)."""

    def __init__(self, db: rocksdict.Rdict, opts: rocksdict.WriteOptions, progress: Progress,
                 gate: WriteGate) -> None:
        super().__init__(db, opts, progress)
        self.gate = gate

    def __call__(self, build: Callable[[], rocksdict.WriteBatch]) -> None:
        gate = self.gate
        gate.enter()

        def checked() -> rocksdict.WriteBatch:
            gate.check()
            return build()
        try:
            super().__call__(checked)
        finally:
            gate.leave()

    def once(self, build: Callable[[], rocksdict.WriteBatch]) -> bool:
        self.gate.enter()  # a closed gate raises WriteStopped: nothing written
        try:
            return super().once(build)
        finally:
            self.gate.leave()


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
    _delete_batch: Any  # Store's
    _gate: WriteGate
    generation: int  # Store's: flushes and replaces counted (ops.FLAG_GENERATION)
    _state_owed: dict[str, bytes]  # server state a write stop kept off the disk (storerecovery.py)
    _owed: Any  # owedeletes.OwedDeletes: stranded deletes recorded for a restart

    def _dirty_state(self) -> tuple[float | None, float, float]:
        with self._lock:
            return self._dirty_since, self._last_write, self._last_unflushed_read

    def _retry_soon(self) -> None:
        """Have the flusher flush (durability "cache") where a write stop left deletes or server state
        for the next flush (_stranded, _state_owed): it flushes only what puts made dirty, and with
        no put after, they waited on disk, the durable mark held back, until one came. A flush
        skipped for the stop leaves it dirty: tried again each tick, once writes go it goes in."""
        if self._dirty_since is None:  # no lock: a put may hold it through a stop; a lost race only flushes
            self._dirty_since = time.monotonic()

    def flush(self) -> bool:
        """Write the memtables to table files; with durability "cache" this makes
        every value written before the call safe from a crash. None (False) once
        closing begins (but close's own), and none RocksDB would hold for a write stop
        that nothing ends (stallwrite.py: it would wait there for ever). Returns
        whether it flushed; a failure is recorded (logged, a RocksDB error fails
        the store), not raised, and the flusher tries again where that may help."""
        return self._flush(final=False)

    @property
    def closing(self) -> bool:
        """close() began: no flush starts but its own (nor does a put start one: diskadmit.py)."""
        return self._gate.closing

    def _flush(self, final: bool) -> bool:
        # first: a flusher's tick after close touches no RocksDB; close waits for one begun
        # (_end_flushes), its first steps too
        if not self._gate.begin_flush(final):
            return False
        try:
            return self.progress.stuck() is None and self._flush_begun(final)
        finally:
            self._gate.end_flush()

    def _flush_begun(self, final: bool) -> bool:
        if self._stranded and not self._drop_stranded():
            self._retry_soon()  # a stop refused them: the flusher comes back for them (dirty, below)
        if self._state_owed:  # server state a write stop kept off the disk (Recovery.keep_state)
            try:  # one try: waiting a stop out under its lock held keep_state (the manager's chunk calls)
                if not self._pay_state(False):
                    self._retry_soon()
            except Exception as e:  # a closing store's; RocksDB's own error fails the store
                self._put_failed(e)
        if self.progress.stuck() is not None:  # those steps may have waited a stop out: RocksDB would hold
            return False  # the flush for it, for ever where its compactions fail (dirty still: retried)
        with self._lock:
            if self.closing and not final:
                return False
            # values from the mark on may not be written yet: those of puts under way, and the
            # index records of puts a write stop ended (their ids not deleted yet)
            mark = min((*self._writing, *self._stranded.values()), default=self._seq)
            dirty, self._dirty_since = self._dirty_since, None  # a write from here on marks it again
        flushed, again = False, True
        try:
            flushed, again = self._flush_files(mark)
        finally:
            with self._lock:
                if self._stranded and dirty is None:  # deletes still owed: a later flush tries them
                    dirty = time.monotonic()
                if (again or self._stranded) and dirty is not None:  # still unflushed: the flusher tries again
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
        with self._lock:
            # before values leave _unflushed (answered LOCAL from then on): a follower whose view
            # predates this flush catches up before it reads them (GET_LOCAL's generation)
            self.generation += 1
            if self.durability == "cache":  # in table files now, whether or not their mark below is written
                self._unflushed = {k: s for k, s in self._unflushed.items() if s >= mark}
        if self.durability != "cache":
            return True, False
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
            self._put_failed(e)  # RocksDB's own error fails the store: no later flush writes it
            if rocksdb_error(e):
                return False
            self._flush_failed(f"writing its durable mark: {e!r}")
            return True

    _failing = False  # the last flush failed, not for RocksDB's own error (said once)

    def _flush_failed(self, why: str) -> None:
        """Said once, not at each of the flusher's retries (every CHECK_S while it lasts)."""
        if not self._failing:
            self._failing = True
            log.warning("flushing the store failed (%s); tried again until it works", why)

    def _drop_stranded(self) -> bool:
        """Delete what is left on disk of the ids of puts and deletes a write stop ended (put_many,
        _delete_keys): an index record without its value, or a value no longer indexed, that a
        restart would index, or keep unaccounted. An id put again since lost its old copies with
        that put (Store._write_index) and left this map; one indexed here all the same keeps its
        held value, and its copy in the other family goes. Ids being put wait. One try, as
        _delete_soon's: under the store's lock, a wait for a stop begun since the flush's check held
        every put, adopt and eviction up to STUCK_S; what a stop refuses stays for a later flush.
        Returns whether none is left."""
        with self._lock:
            stranded, index = self._stranded, self._index
            ready = [k for k in stranded if k not in self._pending]
            gone = [k for k in ready if k not in index]
            back = [(k, index[k][0] >= BLOB_MIN + self.overhead) for k in ready if k in index]
            try:
                if ready and not self._logged.once(lambda: self._stale_batch(gone, back)):
                    return False  # stopped again: kept for later
            except Exception as e:  # a closing or failed store's (the flush records it): kept for later
                self._put_failed(e)
                return False
            for k in ready:
                del stranded[k]
            if not stranded:
                self._owed.clear()  # nothing owed for a restart either
            return not stranded

    def _stale_batch(self, gone: list[bytes], back: list[tuple[bytes, bool]]) -> rocksdict.WriteBatch:
        """Deletes of every record of the ``gone`` ids, and of the copy in the family the held value
        of each (id, large) in ``back`` is not in (written fresh by its put: no legacy large value
        in the default family among them, as _restore keeps none stranded)."""
        wb = self._delete_batch(gone, gone)
        for k, large in back:
            if large:
                wb.delete(k)
            else:
                wb.delete(k, self._large_cf)
        return wb

    def _delete_stale(self, wb: rocksdict.WriteBatch, key: bytes, value: bytes | memoryview, both: bool) -> None:
        """Every record a stop left of a stranded id, in both families (which one its old value is in
        is not known), but in the one this batch writes the new value to (``both``)."""
        large = len(value) >= BLOB_MIN
        if not (both and large):
            wb.delete(key, self._large_cf)
        if not (both and not large):
            wb.delete(key)

    def flush_for_followers(self, min_bytes: int = FOLLOWER_FLUSH_MIN_BYTES) -> bool:
        """Flush the memtables (every column family, so the log can go) if they
        hold at least `min_bytes`. A follower that opens replays the live log
        (~3 ms/MB measured) and so does every other one; one flush (~2 ms/MB)
        makes each open ~5 ms instead. Not while writes are stopped, even for a stop that RocksDB's
        compactions are ending: RocksDB holds a flush until the stop ends, and the server's request
        thread waited that out (a compaction's length) to spare a follower a replay; the follower
        replays the longer log instead. Returns whether it flushed: not when the flush was
        skipped (a write stop, closing) or failed (core.open_follower backs off only after one)."""
        if self._unflushed_bytes() < min_bytes:
            return False
        if self._db.property_int_value(STOPPED):
            return False
        return self.flush()

    def _end_flushes(self, timeout: float = CLOSE_FLUSH_WAIT_S) -> bool:
        """Wait for the flushes under way, the writes of their first steps included (none starts:
        closing). One that waits out a write stop that nothing ends (stallwrite.py), or past
        ``timeout``, is given up: its writes at their next try (the gate shuts), a flush RocksDB
        holds for the stop with RocksDB's background work, cancelled. Returns whether it was."""
        deadline = time.monotonic() + timeout
        while not self._gate.flushes_done(POLL_S):
            why = self.progress.stuck()
            if why is not None or time.monotonic() >= deadline:
                log.warning("closing the store while a flush waits out a write stop (%s); values not "
                            "yet flushed are refetched as misses after restart", why or "it lasted too long")
                self._cancel_background()
                if not self._gate.flushes_done(GIVEN_UP_WAIT_S):
                    log.error("a flush still runs %.0f s after the close gave it up", GIVEN_UP_WAIT_S)
                return True
        return False

    def _given_up_last(self) -> bool:
        """After close's own flush did not go in: where it was skipped for a write stop that nothing
        ends, RocksDB's work is cancelled (returns True), as RocksDB's close flushes too, and
        would hold that flush for the stop."""
        why = self.progress.stuck()
        if why is None:
            return False
        log.warning("closing the store during a write stop (%s); values not yet flushed are refetched "
                    "as misses after restart", why)
        self._cancel_background()
        return True

    def _cancel_background(self) -> None:
        """End RocksDB's background work, and so a flush it holds for a write stop. Its stops are
        lifted first: RocksDB's cancel begins with a flush of values written without the log, which
        it too holds for the stop, for ever where the stop is one of compactions failing (a close
        hung there). A flush may go in now; one without room fails, as RocksDB's close would. Writes
        under way give up first (the gate shuts), or one would go in once the stop is lifted, and
        its value, acknowledged, be lost with the memtable."""
        self._gate.shut()  # each gives up at its next try; close waits for them, and logs one that does not
        for view in (self._db, self._meta, self._server, self._large):  # a stop in any holds all
            try:
                view.set_options({"disable_auto_compactions": "true"})  # no level 0 or pending-bytes stop then
            except Exception as e:  # a failed store's: the cancel below ends what it can
                log.warning("closing the store: its write stop could not be lifted (%s)", e)
        self._db.cancel_all_background(True)

    def close(self) -> None:
        """Flush, then release RocksDB (its LOCK) and the data dir, also after a failed write:
        the embedded cache retries by reopening the same dir in this process. Flushes and writes
        under way end first (a write waiting out a write stop gives up: WriteStopped), or each
        wrote to a closed store. RocksDB's error is raised only where nothing failed before (then
        it is news), once both are released."""
        self._gate.close()  # not under the store's lock: a writer may hold that for a whole stop
        cancelled = False
        try:
            cancelled = self._end_flushes()
            if self._flusher is not None:
                self._flusher.stop()  # its flushes are over; a later tick starts none (closing)
            self.admit.stop()  # a background flush (diskadmit.py) ends first, none starts later
            if not cancelled and not self._flush(final=True):
                cancelled = self._given_up_last()
        finally:  # whatever went wrong above: a lock kept here stays kept for the process's life
            try:
                if not self._gate.shut(GIVEN_UP_WAIT_S):  # puts, state: each gives up at its next try
                    log.error("closing the store while a write still runs %.0f s after it was given up",
                              GIVEN_UP_WAIT_S)
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
