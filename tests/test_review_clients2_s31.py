"""Review (s31) of CachedDataset's loaders and the job's side of the manager (clients/dataset.py,
loader.py, coordination.py, batchreports.py) with a real cachemanager and cacheserver on loopback:
what a loader of a closed dataset raises, and which hit fraction the manager is told for each
batch of a job's two loaders."""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.vocab import Option  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from clients.procstate import DatasetClosed  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from manager.policy.autocache import PipelineCosts  # noqa: E402
from procs import manager_with_server  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N = 100  # items of 10 kB: 1 MB, ten chunks of 100 kB under --chunks


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """(manager, digest path): a manager that chunks the 1 MB dataset into ten 100 kB chunks
    (500 kB budget), with one cache server in its ring."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path = write_files_digest(tmp_path / "ds", (os.urandom(10_000) for _ in range(N)))
    with manager_with_server(str(tmp_path), "--chunks", "--budget", "500kB", "--chunk-size", "100kB") as (m, _):
        yield m, path


def _read_on_after_close(ds, loader) -> None:
    """Hand a batch over, close the dataset, then read on: DatasetClosed for the rest of the
    epoch and for the next one."""
    try:
        it = iter(loader)
        next(it)  # the workers run, and the sampler has run ahead of them
        ds.close()
        with pytest.raises(DatasetClosed, match="was closed: make a new one"):
            for _ in it:
                pass
        with pytest.raises(DatasetClosed, match="was closed: make a new one"):
            next(iter(loader))
    finally:
        loader.close()
        ds.close()


def test_a_loader_read_on_after_close_raises_dataset_closed(chunked):
    """A loader made before ds.close(), read on after it: its DataLoader workers (their own
    copies of the dataset, open) went on handing batches over, and the sampler's hook released
    a chunk read to the end through the closed manager client: a bare "ValueError: Cannot
    invoke RPC on closed channel!" out of the training loop. It is now DatasetClosed, as any
    read after close(), and so is the next epoch (before its workers start)."""
    m, path = chunked
    ds = CachedDataset(path, manager=m.address, job="late")
    assert ds.coordinator.plan.option == Option.CHUNKED and ds.coordinator.plan.k == 10
    _read_on_after_close(ds, ds.loader(batch_size=10, num_workers=2, substitute=False))


def test_a_loaders_workers_read_nothing_for_a_closed_dataset(tmp_path):
    """Without a manager: the persistent workers of a loader made before ds.close() read the
    rest of the epoch, and every later epoch, from a dataset its user had closed (no error at
    all). The loader now raises DatasetClosed at the next batch, as a read in this process does."""
    path = write_files_digest(tmp_path / "ds", (os.urandom(1_000) for _ in range(N)))
    ds = CachedDataset(path, cache=False)
    _read_on_after_close(ds, ds.loader(batch_size=10, num_workers=2))
    with pytest.raises(DatasetClosed, match="was closed: make a new one"):
        ds.loader(batch_size=10)


def test_manager_calls_of_a_closed_coordinator_raise_dataset_closed(chunked):
    """The coordinator a loader's hooks still hold after ds.close(): its chunk release and
    autocache report went through the closed manager client (a bare ValueError); both are
    DatasetClosed now, and the manager is called no more."""
    m, path = chunked
    ds = CachedDataset(path, manager=m.address, job="closed-coord")
    coord = ds.coordinator
    ds.close()
    with pytest.raises(DatasetClosed, match="was closed"):
        coord.consumed(list(range(N)))  # every chunk read to the end: releases were due
    costs = PipelineCosts(items=N, epochs_left=1, source_bytes=1e4, marker_bytes=1e4, store_read_s=1e-3,
                          cache_read_source_s=1e-4, cache_read_marker_s=1e-4, prefix_s=1e-3, rest_s=1e-3,
                          workers=1, cacheable=True)
    with pytest.raises(DatasetClosed, match="was closed"):
        coord.autocache_decision(ds.dataset_tag, "ab" * 16, costs)


def _received(state_dir: str, job: str) -> list:
    """The hit fractions of `job`'s batches as the manager journaled them, in order."""
    out = []
    with open(os.path.join(state_dir, "journal.jsonl")) as f:
        for line in f:
            ev = json.loads(line)["ev"]
            if ev.get("type") == "batches" and ev.get("job") == job:
                out += [b[2] if len(b) > 2 else None for b in ev["batches"]]
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_loaders_batches_carry_its_own_hit_fraction(tmp_path, monkeypatch, num_workers):
    """A job's train loader (batch 10, its items all cached: every batch planned as hits) and
    eval loader (batch 25, substitute=False: every batch planned as misses), the eval run in the
    middle of a train epoch. One sampler (the last loader made) gave every batch's hit fraction:
    the manager was told none for the train batches and 0 for the eval ones (and the eval epoch's
    start dropped the train batches' fractions sampled ahead). Each batch now carries its own
    loader's: 1.0 for the train batches, 0.0 for the eval ones, in the order they were handed over."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path = write_files_digest(tmp_path / "ds", (os.urandom(1_000) for _ in range(N)))
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = CachedDataset(path, manager=m.address, job="two-loaders")
        try:
            warm = ds.loader(batch_size=50)
            for _ in warm:  # every item read once: cached
                pass
            train = ds.loader(batch_size=10, num_workers=num_workers, seed=1)
            evaluate = ds.loader(batch_size=25, substitute=False)
            for k, _ in enumerate(train):
                if k == 3:
                    for _ in evaluate:
                        pass
            assert train.epoch_stats[-1].planned_hit_rate == 1.0
            assert evaluate.epoch_stats[-1].planned_hit_rate == 0.0
        finally:
            ds.close()  # sends what is queued
        got = _received(os.path.join(str(tmp_path), "mgr"), "two-loaders")
    assert got == [0.0, 0.0] + [1.0] * 4 + [0.0] * 4 + [1.0] * 6, got
