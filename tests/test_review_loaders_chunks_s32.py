"""Review (s32): a job reading one dataset through two loaders (train and eval) under a chunked
plan, with a real cachemanager and cacheserver on loopback (clients/coordination.py,
chunkreads.py, batchreports.py). Each loader's epoch counts its own reads per chunk; the job
releases a chunk only once every loader with an epoch in progress has read its items of it; a
batch's time reported to the manager is one step of the job, not another loader's epoch."""
import json
import os
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.vocab import Option  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import manager_with_server  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N = 100  # items of 10 kB: 1 MB, ten chunks of 100 kB under --chunks


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """(manager, dataset) of a manager that chunks the 1 MB dataset into ten 100 kB chunks."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path = write_files_digest(tmp_path / "ds", (os.urandom(10_000) for _ in range(N)))
    with manager_with_server(str(tmp_path), "--chunks", "--budget", "500kB", "--chunk-size", "100kB") as (m, _):
        ds = CachedDataset(path, manager=m.address, job="train-eval")
        try:
            assert ds.coordinator.plan.option == Option.CHUNKED and ds.coordinator.plan.k == 10
            yield m, ds
        finally:
            ds.close()


class Watch:
    """What each loader's sampler issued this epoch, and each release the job made (the real
    call, recorded with which of the chunk's items each loader had read by then)."""

    def __init__(self, ds, **loaders) -> None:
        self.read = {name: None for name in loaders}  # None: not in an epoch
        self.releases: list[tuple[int, set, dict]] = []
        for name, loader in loaders.items():
            self._watch(name, loader.batch_sampler)
        coord = ds.coordinator
        real = coord.client.release_chunk

        def release_chunk(job, dataset, c):
            members = {i for r in coord.plan.members(c) for i in r}
            self.releases.append((c, members, {k: set(v) for k, v in self.read.items() if v is not None}))
            return real(job, dataset, c)
        coord.client.release_chunk = release_chunk

    def _watch(self, name, sampler) -> None:
        on_batch, on_epoch = sampler.on_batch, sampler.on_epoch

        def batch(b):
            self.read[name].update(b)  # before the release this batch may make
            on_batch(b)

        def epoch(items):
            self.read[name] = set()
            on_epoch(items)
        sampler.on_batch, sampler.on_epoch = batch, epoch

    def end(self, name) -> None:
        self.read[name] = None

    def early(self) -> list[tuple[int, dict]]:
        """Releases made while a loader in its epoch had not read all of the chunk."""
        return [(c, {k: len(members - got) for k, got in read.items() if members - got})
                for c, members, read in self.releases if any(members - got for got in read.values())]


def test_an_eval_epoch_inside_a_train_epoch_releases_no_chunk_train_has_not_read(chunked):
    """Train reads 60 items, then a whole eval epoch runs, then train reads on. The job counted
    reads per job and each loader's epoch start reset the count: eval's start wiped train's 60
    items, and eval's reads released every listed chunk although train had read few of their
    items (then train's first reads after eval "completed" chunks on eval's reads). Each loader
    now counts its own; a chunk goes only once both (while in their epochs) have read it."""
    _, ds = chunked
    train = ds.loader(batch_size=10, substitute=False, seed=1)
    evaluate = ds.loader(batch_size=25, substitute=False, seed=2)
    watch = Watch(ds, train=train, eval=evaluate)
    for k, _ in enumerate(train):
        if k == 5:  # 60 items read
            for _ in evaluate:
                pass
            watch.end("eval")
    assert watch.early() == [], watch.early()
    assert watch.releases, "the train epoch read every chunk: releases were due"
    assert train.epoch_stats[-1].items == N and evaluate.epoch_stats[-1].items == N


def test_a_loader_whose_epoch_stopped_early_holds_no_chunk(chunked):
    """An eval epoch begun inside the train epoch and left after one batch (break) holds
    nothing: train's reads alone release the listed chunks it reads to the end."""
    _, ds = chunked
    train = ds.loader(batch_size=10, substitute=False, seed=1)
    evaluate = ds.loader(batch_size=25, substitute=False, seed=2)
    watch = Watch(ds, train=train, eval=evaluate)
    for k, _ in enumerate(train):
        if k == 2:
            for _ in evaluate:
                break
            watch.end("eval")
    assert evaluate.epoch_stats[-1].complete is False
    assert watch.early() == [], watch.early()
    assert watch.releases, "train read every chunk after eval stopped: releases were due"
    assert {c for c, _, _ in watch.releases} >= {0}


def _durations(state_dir: str, job: str) -> list[float]:
    """The durations of `job`'s batches as the manager journaled them, in order."""
    out = []
    with open(os.path.join(state_dir, "journal.jsonl")) as f:
        for line in f:
            ev = json.loads(line)["ev"]
            if ev.get("type") == "batches" and ev.get("job") == job:
                out += [b[1] for b in ev["batches"]]
    return out


def test_a_train_batch_after_an_eval_epoch_reaches_the_manager_as_one_step(tmp_path, monkeypatch):
    """The train batch handed over after an eval epoch run inside the train epoch reached the
    manager as one batch as long as the whole eval epoch (it skews the regression of batch
    time on hit fraction). Its time now runs from the job's last batch handed over (eval's)."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path = write_files_digest(tmp_path / "ds", (os.urandom(1_000) for _ in range(N)))
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = CachedDataset(path, manager=m.address, job="two-loaders")
        try:
            train = ds.loader(batch_size=10, seed=1)
            evaluate = ds.loader(batch_size=25, substitute=False)
            for k, _ in enumerate(train):
                if k == 3:
                    for _ in evaluate:
                        time.sleep(0.2)  # the eval step: 0.8 s over the eval epoch
        finally:
            ds.close()  # sends what is queued
        got = _durations(os.path.join(str(tmp_path), "mgr"), "two-loaders")
    assert len(got) == 14, got
    assert all(d >= 0.2 for d in got[5:8]), got  # eval's batches after its first: one step each
    assert got[8] < 0.4, got  # train's fifth batch: not the eval epoch's 0.8 s
    # Its own interval, as the loader's epoch stats keep it, spans the eval epoch
    assert max(train.batch_times) >= 0.8


@pytest.mark.parametrize("train_workers,eval_workers", [(0, 0), (2, 0), (0, 2)])
def test_each_loaders_epoch_stats_count_its_own_reads(tmp_path, monkeypatch, train_workers, eval_workers):
    """An epoch's hits and misses were the dataset's counters' change over the epoch: an eval
    epoch (100 items) run inside a train epoch made the train epoch report 200 reads for its 100
    items. Each epoch now counts its own loader's reads (its workers' or this process's); the
    dataset's counters still count every read."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path = write_files_digest(tmp_path / "ds", (os.urandom(1_000) for _ in range(N)))
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = CachedDataset(path, manager=m.address, job="two-loaders-stats")
        try:
            train = ds.loader(batch_size=10, num_workers=train_workers, seed=1)
            evaluate = ds.loader(batch_size=25, num_workers=eval_workers, seed=2)
            for k, _ in enumerate(train):
                if k == 3:
                    for _ in evaluate:
                        pass
            t, e = train.epoch_stats[-1], evaluate.epoch_stats[-1]
            assert (t.items, t.hits + t.misses) == (N, N), t
            assert (e.items, e.hits + e.misses) == (N, N), e
            assert t.inserted + e.inserted == ds.counters.totals()["inserted"]
            totals = ds.counters.totals()
            assert totals["hits"] + totals["misses"] == 2 * N
        finally:
            train.close()
            evaluate.close()
            ds.close()
