"""Per-item preprocessing cost, remembered across epochs and jobs.

Keyed by (pipeline key, item content digest): the same bytes through the same
pipeline cost the same wherever they sit in a dataset, so a later job (or a
rerun with another digest file over the same files) knows which items are slow
before it starts and schedules them first. Kept in SQLite under the cache dir,
which serialises concurrent jobs' writes; costs are smoothed (EWMA) so one noisy
epoch does not flip an item. A memory that cannot be opened is not an error:
the loader works without it (costs are hints)."""
from __future__ import annotations

import os
import sqlite3
import warnings
from collections.abc import Iterable

KEEP = 0.5  # weight of the remembered cost against the latest measurement
DIGEST_BYTES = 16


class CostMemory:
    def __init__(self, directory: str, pipeline_key: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "item-costs.sqlite")
        self.key = pipeline_key
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS cost (pipeline TEXT, item BLOB, seconds REAL, "
                         "PRIMARY KEY (pipeline, item)) WITHOUT ROWID")
        self._db.commit()

    def load(self) -> dict[bytes, float]:
        rows = self._db.execute("SELECT item, seconds FROM cost WHERE pipeline = ?", (self.key,))
        return {bytes(item): s for item, s in rows}

    def update(self, measured: Iterable[tuple[bytes, float]]) -> None:
        rows = [(self.key, d[:DIGEST_BYTES], s) for d, s in measured]
        with self._db:
            self._db.executemany(
                "INSERT INTO cost VALUES (?, ?, ?) ON CONFLICT (pipeline, item) DO UPDATE SET "
                f"seconds = {KEEP} * seconds + {1 - KEEP} * excluded.seconds", rows)

    def close(self) -> None:
        self._db.close()


def open_memory(directory: str | None, pipeline_key: str) -> CostMemory | None:
    if directory is None:
        return None
    try:
        return CostMemory(directory, pipeline_key)
    except (OSError, sqlite3.Error) as e:
        warnings.warn(f"item cost memory at {directory} unavailable ({e}); scheduling without it", stacklevel=2)
        return None


def default_dir() -> str:
    base = os.environ.get("MLCACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlcache")
    return os.path.join(base, "preprocess")
