"""Two loaders of one dataset (train and eval) whose DataLoader workers read at once: the
dataset's counters (clients/stats.py) lose no count. Each loader's worker 0 added to one
row (worker id + 1), two processes reading and writing one number at once: adds were lost
(now and then: the rows each worker added to say it every time)."""
import os
import sys
import threading

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.stats import FIELDS, MAX_ROWS  # noqa: E402
from filedigest import write_files_digest  # noqa: E402

pytestmark = pytest.mark.timeout(300)
N, SIZE = 300, 64  # tiny items, a batch each: adds as often as workers can make them
WORKERS, EPOCHS = 2, 8


def rows_read_in(counters) -> int:
    """How many rows of `counters` have reads counted in them (a row per process that read)."""
    a, w = counters._rows._arr, len(FIELDS)
    hits, misses = FIELDS.index("hits"), FIELDS.index("misses")
    return sum(1 for r in range(MAX_ROWS) if a[r * w + hits] or a[r * w + misses])


def _run(loader, epochs: int, errors: list) -> None:
    try:
        for _ in range(epochs):
            for _ in loader:
                pass
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


def test_two_loaders_workers_reading_at_once_lose_no_counts(tmp_path):
    path = write_files_digest(tmp_path / "ds", (os.urandom(SIZE) for _ in range(N)))
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"), capacity="64MB")
    try:
        loaders = [ds.loader(batch_size=1, num_workers=WORKERS, seed=s) for s in (1, 2)]
        errors: list = []
        threads = [threading.Thread(target=_run, args=(lo, EPOCHS, errors)) for lo in loaders]
        for t in threads:  # both loaders' workers read at once (persistent, as by default)
            t.start()
        for t in threads:
            t.join(240)
        assert not errors and not any(t.is_alive() for t in threads), errors
        read = 2 * EPOCHS * N  # items the two loaders read
        assert sum(s.items for lo in loaders for s in lo.epoch_stats) == read
        # every read adds the same counts to the dataset's counters and to its loader's (rows
        # of one loader's own workers, never shared): what the dataset lacks, it lost
        totals, own = ds.counters.totals(), [lo.counters.totals() for lo in loaders]
        assert totals == {f: own[0][f] + own[1][f] for f in FIELDS}, (totals, own)
        assert totals["hits"] + totals["misses"] == read, totals
        assert [o["hits"] + o["misses"] for o in own] == [EPOCHS * N] * 2, own
        assert rows_read_in(ds.counters) == 2 * WORKERS  # each worker process a row of its own
    finally:
        ds.close()
