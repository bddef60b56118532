"""Durable manager state: snapshot + append-only journal under ``--state-dir``.

Layout::

    STATE_DIR/LOCK            flock: one manager per state directory
    STATE_DIR/snapshot.json   {"seq": S, "digest": sha256, "state": {...}}
    STATE_DIR/journal.jsonl   one {"crc": c, "ev": {...}, "seq": n} per line, n > S

Every state change is an event (model.py). ``submit`` applies it, appends it
to the journal and fsyncs *before* the caller answers the RPC, so whatever a
client or server was told survives ``kill -9`` and power loss -- except batch
reports (``UNSYNCED``): written at once (so they survive ``kill -9``) but made
durable by the next fsynced event or snapshot. They promise a client nothing, and
losing the last seconds of them to a power loss only delays a benefit estimate;
fsyncing each one (several a second with many jobs) made the disk commit the
cache servers' writes too, on the same machine. Every
``snapshot_every`` events the whole state is written to a temporary file,
fsynced, and renamed over the snapshot (atomic), then the journal is
truncated; a crash between rename and truncation only leaves events the
loader skips by sequence number. Loading = snapshot + re-applying the
journal's events in order, which gives the identical state because the model
is deterministic. A torn last line (crash mid-write: never acknowledged) is
cut off; damage anywhere else stops the manager rather than guessing. Each
line carries the CRC-32 of its record (the line without "crc"), so a flipped
byte that leaves valid JSON (a digit, a key) is damage too, not an event
replayed with another value; lines written before the CRC have none.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .effects import Effect
from .model import ManagerConfig, ManagerModel, Rejected, canonical

log = logging.getLogger("manager.state")
T = TypeVar("T")


class StateError(RuntimeError):
    """The state directory cannot be used (locked, damaged)."""


# Events journaled without an fsync of their own (see the module's docstring).
UNSYNCED = frozenset({"batches"})


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record_line(seq: int, ev: Mapping[str, Any]) -> str:
    """A journal line: the record, then the CRC-32 of its text (checked by _checked)."""
    body = json.dumps({"seq": seq, "ev": ev}, sort_keys=True, separators=(",", ":"))
    return f'{{"crc":{zlib.crc32(body.encode())},{body[1:]}\n'


def _checked(rec: dict, path: str, lineno: int) -> dict:
    """rec less its "crc", which must be that of the rest's text; StateError otherwise: a
    complete line that parses is no torn write, and replaying it would diverge silently."""
    crc = rec.pop("crc", None)
    if crc is not None:
        body = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
        if crc != zlib.crc32(body):
            raise StateError(f"{path}: event {rec.get('seq')} at line {lineno} is damaged (its checksum "
                             f"does not match)")
    return rec


def _parse_journal(data: bytes, path: str) -> tuple[list[tuple[int, int, dict]], bytes]:
    """(records as (line number, seq, event), the bytes to keep). Unparseable
    lines are tolerated only at the end (a torn or zero-filled tail after a
    crash: never acknowledged, since acknowledging waits for the fsync)."""
    records: list[tuple[int, int, dict]] = []
    bad_at: int | None = None  # byte offset of the first unparseable line
    pos, lineno = 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        line = data[pos:end].strip()
        lineno += 1
        if line:
            try:
                rec = json.loads(line)
                if isinstance(rec, dict):
                    rec = _checked(rec, path, lineno)
                item = (lineno, int(rec["seq"]), dict(rec["ev"]))
            except (ValueError, KeyError, TypeError):
                if bad_at is None:
                    bad_at = pos
            else:
                if bad_at is not None:
                    raise StateError(f"{path}: damaged record before line {lineno}")
                records.append(item)
        pos = end
    keep = data if bad_at is None else data[:bad_at]
    if keep and not keep.endswith(b"\n"):
        keep += b"\n"  # a complete record that lost its newline: the next append starts a line
    return records, keep


# The parts of a snapshot's state this version reads (ManagerModel.to_dict names them after its fields).
MODEL_PARTS = frozenset(f.name for f in dataclasses.fields(ManagerModel))


def _read_snapshot(path: str) -> tuple[int, ManagerModel]:
    """(seq, model) of a snapshot file; StateError naming the file and what is wrong with it."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        state, seq = doc["state"], int(doc["seq"])
        if not isinstance(state, dict):
            raise TypeError(f"its state is a {type(state).__name__}, not an object")
    except (ValueError, KeyError, TypeError) as e:  # not JSON (UnicodeDecodeError too), not a snapshot
        raise StateError(f"{path}: not a readable snapshot (damaged or truncated): {e!r}") from None
    if hashlib.sha256(canonical(state)).hexdigest() != doc.get("digest"):
        raise StateError(f"{path}: digest mismatch (damaged snapshot)")
    unknown = sorted(set(state) - MODEL_PARTS)
    if unknown:  # a newer manager's state: dropping those parts would lose them silently
        raise StateError(f"{path}: written by a newer cachemanager (state parts {unknown} unknown to this one)")
    try:
        return seq, ManagerModel.from_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StateError(f"{path}: a state this cachemanager cannot read (written by a newer one, "
                         f"or damaged): {e!r}") from None


class StateStore:
    def __init__(self, state_dir: str, config: ManagerConfig, *, snapshot_every: int = 1000,
                 fsync: bool = True, clock: Callable[[], float] = time.time,
                 on_effects: Callable[[list[Effect]], None] | None = None) -> None:
        self.dir = state_dir
        self.config = config
        self.snapshot_every = max(1, snapshot_every)
        self.fsync = fsync
        self.clock = clock
        self.on_effects = on_effects
        self.lock = threading.RLock()
        self.model = ManagerModel(config)
        self.seq = 0
        self.replayed = 0
        self.since_snapshot = 0
        self.events_written = 0
        self.snapshots = 0
        self._journal_fd: int | None = None
        self._lock_fd: int | None = None
        self.broken: str | None = None  # why the durable state could not be reloaded: no change goes on

    @property
    def snapshot_path(self) -> str:
        return os.path.join(self.dir, "snapshot.json")

    @property
    def journal_path(self) -> str:
        return os.path.join(self.dir, "journal.jsonl")

    # ---------------------------------------------------------------- open / load
    def open(self, on_loaded: Callable[[], None] | None = None) -> "StateStore":
        """Lock, load and compact the state. ``on_loaded`` runs once it is loaded, before a
        ``configure`` event for changed flags: their effects (a re-plan's EvictDatasets)
        go to an ``on_effects`` that already knows what the state kept (actuator.restore)."""
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close(snapshot=False)
            raise StateError(f"{self.dir} is in use by another cachemanager") from None
        try:
            with self.lock:
                self._load()
                self._journal_fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if on_loaded is not None:
                    on_loaded()
                if self.seq == 0:
                    self._start_versions()
                if self.model.config != self.config:
                    # Flags changed since the state was written: the change is an
                    # event like any other, so replay stays exact.
                    self.submit({"type": "configure", "config": self.config.to_dict(), "now": self.clock()})
                self.snapshot()  # start from a compact journal
        except BaseException:
            self.close(snapshot=False)  # the lock too: a repaired directory opens again in this process
            raise
        return self

    def _start_versions(self) -> None:
        """A state with no event yet (a new or emptied --state-dir) starts its plan versions at
        the wall clock in ms: a manager that lost its state may have handed out versions from 1
        on, and a client holding one of them would take a new plan of the same number for the
        one it has (and keep that plan's release bookkeeping). Above them as long as those grew
        by fewer than 1000 a second on average (a few per chunk turn) and the clock did not go
        back across the restart. Journaled, so replay gives the same versions. Its ``now`` is the
        state's own (0): the model's clock never goes back, and events may carry earlier times."""
        self.submit({"type": "plan_floor", "floor": int(self.clock() * 1000), "now": self.model.now})

    def _load(self) -> None:
        snap_seq = 0
        if os.path.exists(self.snapshot_path):
            snap_seq, self.model = _read_snapshot(self.snapshot_path)
        self.seq = snap_seq
        if not os.path.exists(self.journal_path):
            return
        with open(self.journal_path, "rb") as f:
            data = f.read()
        records, keep = _parse_journal(data, self.journal_path)
        for lineno, seq, ev in records:
            if seq <= self.seq:
                continue  # already in the snapshot
            if seq != self.seq + 1:
                raise StateError(f"{self.journal_path}: sequence gap at line {lineno} ({self.seq} -> {seq})")
            try:
                self.model.apply(ev)
            except Rejected as e:  # a journaled event always applied once: refuse to diverge silently
                raise StateError(f"{self.journal_path}: journal event {seq} no longer applies: {e}") from None
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # fields missing or mistyped
                raise StateError(f"{self.journal_path}: event {seq} at line {lineno} cannot be replayed "
                                 f"(damaged, or written by a newer cachemanager): {e!r}") from None
            self.seq = seq
            self.replayed += 1
        if keep != data:
            log.warning("journal: dropping a torn tail of %d bytes", len(data) - len(keep.rstrip(b"\n")))
            # In place: cut to the last good record, then add its newline if it lost it. Never
            # open(..., "wb"): a crash between its truncation to 0 and the rewrite lost every event.
            good = keep if data.startswith(keep) else keep[:-1]
            with open(self.journal_path, "r+b") as f:
                f.truncate(len(good))
                f.seek(len(good))
                f.write(keep[len(good):])
                f.flush()
                os.fsync(f.fileno())
        log.info("state loaded: snapshot seq %d, %d journal events replayed", snap_seq, self.replayed)

    # ---------------------------------------------------------------- changes
    def submit(self, ev: Mapping[str, Any], only_if_changed: bool = False) -> list[Effect]:
        """Apply an event and journal it (fsynced) before returning its effects.
        ``only_if_changed``: skip the journal when the state did not change
        (periodic ticks). Raises ``Rejected`` for refused requests."""
        ev = dict(ev)
        ev.setdefault("now", self.clock())
        with self.lock:
            self._check_usable()
            prev_now = self.model.now
            before = self._fingerprint() if only_if_changed else None
            try:
                effects = self.model.apply(ev)
            except Rejected:
                raise
            except Exception:
                # A bug half-way through an event would leave memory ahead of
                # the journal: go back to what is durable, then report it.
                log.exception("event %s failed; reloading the durable state", ev.get("type"))
                self._reload()
                raise
            if before is not None and self._fingerprint() == before:
                # Nothing but the clock moved: forget this event entirely (also
                # its `now`, which clamps later events), so memory == replay.
                self.model.now = prev_now
            else:
                try:
                    self._append(ev, sync=ev.get("type") not in UNSYNCED)
                except OSError:
                    # Not durable, so it must not have happened: back to the disk state
                    # (_append cut the record off; where it could not, the store is broken).
                    log.critical("journal write failed; dropping the event", exc_info=True)
                    if self.broken is None:
                        self._reload()
                    raise
            if self.on_effects is not None and effects:
                self.on_effects(effects)
            if self.since_snapshot >= self.snapshot_every:
                self._try_snapshot()
            return effects

    def _try_snapshot(self) -> None:
        """A snapshot after a durable event: one that fails (a full disk) is logged and tried
        again at the next event; the event stands, so its caller is answered as usual."""
        try:
            self.snapshot()
        except OSError:
            log.error("state snapshot failed; the journal keeps every event, retrying at the next one",
                      exc_info=True)

    def _fingerprint(self) -> bytes:
        d = self.model.to_dict()
        d.pop("now")
        return canonical(d)

    def _append(self, ev: Mapping[str, Any], sync: bool = True) -> None:
        assert self._journal_fd is not None, "state store is not open"
        data = _record_line(self.seq + 1, ev).encode()
        start = os.lseek(self._journal_fd, 0, os.SEEK_END)  # where the record goes (O_APPEND)
        try:
            written = os.write(self._journal_fd, data)
            if written != len(data):  # disk full: fail-stop rather than diverge
                raise OSError(f"short journal write ({written} of {len(data)} bytes)")
            if self.fsync and sync:
                os.fsync(self._journal_fd)
        except OSError:
            self._cut_back(start)
            raise
        self.seq += 1
        self.since_snapshot += 1
        self.events_written += 1

    def _cut_back(self, start: int) -> None:
        """Cut off a record whose write or fsync failed: its caller is answered that nothing
        was decided, so the reload that follows must not find it whole (a line whose fsync
        failed, one short of only its newline) and replay it. Where the cut fails too, the
        disk may hold the record or not: no change is taken until a restart reads the disk."""
        assert self._journal_fd is not None
        try:
            os.ftruncate(self._journal_fd, start)
        except OSError as e:
            self.broken = f"a journal record that failed could not be cut off: {e}"
            log.critical("journal: %s; no change is taken until cachemanager is restarted", self.broken)

    def _reload(self) -> None:
        """Back to the durable state. If that fails, memory holds no state (an empty model at
        sequence 0): the store stops taking changes and snapshots rather than journal events
        under numbers used already, or write the empty model over the snapshot."""
        self.model = ManagerModel(self.config)
        self.seq = 0
        self.replayed = 0
        try:
            self._load()
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            log.critical("state reload failed; no change is taken until cachemanager is restarted: %s",
                         self.broken)
            raise

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise StateError(f"{self.dir}: a reload of the durable state failed ({self.broken}); the state "
                             f"takes no change until cachemanager is restarted (it then says what is wrong)")

    def snapshot(self) -> None:
        with self.lock:
            self._check_usable()
            state = self.model.to_dict()
            doc = {"seq": self.seq, "digest": hashlib.sha256(canonical(state)).hexdigest(),
                   "written_at": time.time(), "state": state}
            tmp = self.snapshot_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(json.dumps(doc, sort_keys=True).encode())
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self.snapshot_path)
            if self.fsync:
                _fsync_dir(self.dir)  # the rename itself must be durable before the journal goes
            if self._journal_fd is not None:
                os.ftruncate(self._journal_fd, 0)
                if self.fsync:
                    os.fsync(self._journal_fd)
            self.since_snapshot = 0
            self.snapshots += 1

    # ---------------------------------------------------------------- reads
    def read(self, fn: Callable[[ManagerModel], T]) -> T:
        """Run ``fn`` on the model under the lock (return copies, not live objects)."""
        with self.lock:
            return fn(self.model)

    def close(self, snapshot: bool = True) -> None:
        with self.lock:
            if snapshot and self._journal_fd is not None and self.broken is None:
                self.snapshot()
            if self._journal_fd is not None:
                os.close(self._journal_fd)
                self._journal_fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
