"""Server-side chunk table: the active chunk per dataset and which jobs hold
references to which chunks. The manager decides; servers record and enforce
("refuse to evict a referenced chunk unless forced"). Persisted as JSON in the
store's server column family, so references survive a restart. A saved table that
cannot be read is dropped with one warning: the manager sets chunks and references
again (Actuator.reconcile), and a server that refused to start over it lost everything.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from .vocab import BadRequest

log = logging.getLogger("cacheserver")
STATE_KEY = "chunks"  # the table's key in the store's server-wide state


class CorruptChunkTable(ValueError):
    """The saved table is not JSON of the shape _persist writes."""


def _chunk(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise CorruptChunkTable(f"{where}: chunk {value!r} is not an integer >= 0")
    return value


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise CorruptChunkTable(f"{where}: {value!r} is not a non-empty string")
    return value


def parse_state(raw: bytes) -> tuple[dict[str, int], dict[tuple[str, int], set[str]]]:
    """(active, refs) of a saved table; CorruptChunkTable naming what is wrong."""
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptChunkTable(f"not JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("active", {}), dict) \
            or not isinstance(state.get("refs", []), list):
        raise CorruptChunkTable("not an object with an 'active' object and a 'refs' list")
    active = {_name(d, "active"): _chunk(c, "active") for d, c in state.get("active", {}).items()}
    refs: dict[tuple[str, int], set[str]] = {}
    for i, ref in enumerate(state.get("refs", [])):
        if not isinstance(ref, list) or len(ref) != 3 or not isinstance(ref[2], list):
            raise CorruptChunkTable(f"refs[{i}]: {ref!r} is not [dataset, chunk, [job, ...]]")
        key = (_name(ref[0], f"refs[{i}]"), _chunk(ref[1], f"refs[{i}]"))
        refs[key] = {_name(j, f"refs[{i}] job") for j in ref[2]}
    return active, refs


class UnknownChunk(LookupError):
    """A chunk call named a chunk this server has no record of."""


class ChunkBusy(RuntimeError):
    """Eviction of a chunk that jobs still reference, without force."""


class ChunkTable:
    def __init__(self, load: Callable[[], bytes | None], save: Callable[[bytes], None]) -> None:
        self._lock = threading.Lock()
        self._save = save
        self.active: dict[str, int] = {}
        self.refs: dict[tuple[str, int], set[str]] = {}
        raw = load()
        if raw:
            try:
                self.active, self.refs = parse_state(raw)
            except CorruptChunkTable as e:
                self._drop_corrupt(raw, e)

    def _drop_corrupt(self, raw: bytes, err: CorruptChunkTable) -> None:
        """Start with an empty table, saved over the unreadable one so that it is dropped once."""
        log.warning("dropped the saved chunk table (server state %r, %d bytes) as corrupt: %s; active "
                    "chunks and job references start empty (the manager sets them again), cached items "
                    "are kept", STATE_KEY, len(raw), err)
        try:
            self._persist()
        except Exception as e:  # a store that cannot write now: the next load drops it again
            log.warning("could not save the emptied chunk table: %s", " ".join(str(e).split()))

    def _persist(self) -> None:
        state = {"active": self.active,
                 "refs": [[d, c, sorted(j)] for (d, c), j in self.refs.items() if j]}
        self._save(json.dumps(state, sort_keys=True).encode())

    @staticmethod
    def _check(dataset: str, chunk: int) -> None:
        if not dataset:
            raise BadRequest("dataset must not be empty")
        if chunk < 0:
            raise BadRequest(f"chunk must be >= 0, got {chunk}")

    def set_active(self, dataset: str, chunk: int) -> int:
        if not dataset:
            raise BadRequest("dataset must not be empty")
        with self._lock:
            if chunk >= 0:
                self.active[dataset] = chunk
                self._persist()
            return self.active.get(dataset, -1)

    def ref(self, dataset: str, chunk: int, job: str) -> int:
        self._check(dataset, chunk)
        if not job:
            raise BadRequest("job must not be empty")
        with self._lock:
            holders = self.refs.setdefault((dataset, chunk), set())
            holders.add(job)
            self._persist()
            return len(holders)

    def unref(self, dataset: str, chunk: int, job: str, known: bool) -> int:
        self._check(dataset, chunk)
        with self._lock:
            holders = self.refs.get((dataset, chunk))
            if holders is None or job not in holders:
                if not known and holders is None:
                    raise UnknownChunk(f"unknown chunk {chunk} of dataset {dataset!r}")
                raise UnknownChunk(f"job {job!r} holds no reference to chunk {chunk} of dataset {dataset!r}")
            holders.discard(job)
            if not holders:
                del self.refs[(dataset, chunk)]
            self._persist()
            return len(holders)

    def before_evict(self, dataset: str, chunk: int, force: bool, known: bool) -> None:
        """Raise unless the chunk may be evicted now; forget its references if it may."""
        self._check(dataset, chunk)
        with self._lock:
            holders = self.refs.get((dataset, chunk), set())
            if not known and not holders and self.active.get(dataset) != chunk:
                raise UnknownChunk(f"unknown chunk {chunk} of dataset {dataset!r}")
            if holders and not force:
                raise ChunkBusy(f"chunk {chunk} of dataset {dataset!r} is referenced by "
                                f"{len(holders)} job(s): {', '.join(sorted(holders))}; use force")
            self.refs.pop((dataset, chunk), None)
            if self.active.get(dataset) == chunk:
                del self.active[dataset]
            self._persist()

    def forget_dataset(self, dataset: str) -> None:
        with self._lock:
            self.active.pop(dataset, None)
            for key in [k for k in self.refs if k[0] == dataset]:
                del self.refs[key]
            self._persist()

    @classmethod
    def persisted(cls, load: Callable[[], bytes | None], repair: Callable[[bytes], None]) -> "ChunkTable":
        """The table as last saved (a store's recovery: CacheCore loads its own later), saved
        (``repair``) only to replace one that could not be read."""
        return cls(load, repair)

    def is_protected(self, tag: tuple[str, int]) -> bool:
        """Referenced or active chunks are kept by the fallback eviction policy."""
        dataset, chunk = tag
        return bool(self.refs.get(tag)) or (dataset != "" and self.active.get(dataset) == chunk)

    def holders(self, dataset: str, chunk: int) -> list[str]:
        with self._lock:
            return sorted(self.refs.get((dataset, chunk), ()))
