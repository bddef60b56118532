"""Review of CachedDataset.close() (clients/dataset.py, clients/procstate.py) with real cacheserver,
cachemanager and object store processes on loopback: a coordination thread that outlives the
coordinator's close() keeps the process state it is using until it ends, and only then is that
state closed; a dataset refuses reads once closed rather than opening its clients again; and a
construction that fails after registering its job lets go of the job and its token file."""
import logging
import threading

import pytest

pytest.importorskip("torch")

from clients import coordination  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from clients.procstate import DatasetClosed  # noqa: E402
from procs import cachemanager, cacheserver, wait_ring, wait_until  # noqa: E402
from test_review_coordination2_s29 import slow_chunked  # noqa: E402
from test_dataset import make_dataset  # noqa: E402


def _state_threads() -> list[threading.Thread]:
    """Live threads of a dataset's process state (its store reads, its ring client's pool) that
    this test made: not those alive as it began (an earlier module of this pytest worker's, seen
    in CI, would fail the test that made none of them: `_earlier`)."""
    return [t for t in threading.enumerate()
            if t.name.startswith(("store-fetch", "ring")) and t.ident not in _earlier]


_earlier: set = set()


@pytest.fixture(autouse=True)
def _threads_before():
    _earlier.clear()
    _earlier.update(t.ident for t in threading.enumerate())
    yield


def test_a_coordination_thread_outliving_close_keeps_its_state_until_it_ends(tmp_path, monkeypatch, caplog):
    """close() gave up waiting for the coordination thread amid a prefetch part from a slow store
    and closed the process state under it: the part's items, read from the store, were then put
    through a closed client and lost ("a cache server refused a put ... the client ... is closed",
    a warning said once per process, so a real refusal later went unsaid). Now the state stays
    open until the thread ends, then is closed: every item read is cached, nothing is left."""
    monkeypatch.setattr(coordination, "CLOSE_WAIT_S", 0.2)  # close() gives up amid the first part
    with slow_chunked(tmp_path, monkeypatch) as (ds, store, srv):
        coord = ds.coordinator
        coord.start()
        wait_until(lambda: store.stats(by_path=False)["bytes_served"] >= 18_000, "a paced prefetch part", 15)
        with caplog.at_level(logging.WARNING):
            ds.close()
            thread = coord._thread
            assert thread.is_alive()  # the case under review: close() returned before the thread ended
            with pytest.raises(DatasetClosed, match="was closed"):
                ds[0]  # this thread may not use the state the coordination thread still holds
            thread.join(30)
            assert not thread.is_alive()
            wait_until(lambda: ds._state is None and not _state_threads(), "the state closed after the thread", 10)
        assert not [r for r in caplog.records if "is closed" in r.getMessage()], caplog.text
        read = sorted(int(p.rsplit("img", 1)[1][:5]) for p, e in store.stats()["by_path"].items()
                      if p.endswith(".bin") and e["bytes"] >= 1000)
        assert read
        check = CachedDataset(str(tmp_path / "http.digest"), cache=srv.address)
        try:
            assert all(check.lookup(read)), "items read from the store after close() were not put"
        finally:
            check.close()


def test_a_closed_dataset_refuses_reads_instead_of_opening_its_clients_again(tmp_path):
    """A read after close() made the process state again (a ring client, thread pools, the host's
    coalescing directory) that nobody would close. It raises DatasetClosed now; closing twice is
    harmless, and another dataset sharing the embedded cache keeps it."""
    path, items = make_dataset(tmp_path / "ds", n=20)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    other = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        assert ds[3] == items[3]
        ds.close()
        ds.close()
        with pytest.raises(DatasetClosed, match="was closed: make a new one"):
            ds[3]
        with pytest.raises(DatasetClosed):
            ds.lookup([3])
        assert ds._state is None
        assert other[3] == items[3]  # the embedded cache was released once, by ds: other still holds it
    finally:
        other.close()
        ds.close()


def test_a_construction_failing_after_registering_lets_go_of_the_job(tmp_path, monkeypatch):
    """CachedDataset(manager=..., job=...) registered the job and claimed its token file, then
    raised (here: the manager knew no servers yet); the job and the token stayed held by the
    failed object, so the retry in the same process was refused as another running holder of
    the job (JobRefused) for --job-timeout-seconds. Now the failed construction closes them."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path, items = make_dataset(tmp_path / "ds", n=20)
    m = cachemanager(str(tmp_path / "m"), 0).start()
    srv = None
    try:
        with pytest.raises(ValueError, match="knows no cache servers yet"):
            CachedDataset(path, manager=m.address, job="named")
        srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address).start()
        wait_ring(m.address, 1)
        ds = CachedDataset(path, manager=m.address, job="named")  # the retry
        try:
            assert ds.coordinator.reached and ds[5] == items[5]
        finally:
            ds.close()
    finally:
        if srv is not None:
            srv.kill()
        m.kill()


@pytest.mark.parametrize("workers", [0, 2])
def test_close_from_another_thread_ends_the_epoch_with_a_clear_error(tmp_path, workers):
    """Another thread closed the dataset while the training loop iterated its loader
    (num_workers=0): the next batch opened the process state again and the epoch read on, so
    that state (a ring client, thread pools) outlived close() for good; with workers the
    sampler's look-ahead swallowed the error and the workers read on. The next batch now
    raises DatasetClosed, the epoch is recorded as stopped early, and nothing is left open."""
    path, items = make_dataset(tmp_path / "ds", n=64)
    srv = cacheserver(str(tmp_path / "srv"), "64MB").start()
    try:
        ds = CachedDataset(path, cache=srv.address)
        loader = ds.loader(batch_size=8, seed=0, num_workers=workers)
        got = []
        with pytest.raises(DatasetClosed, match="was closed"):
            for batch in loader:
                got += batch
                if len(got) == 8:
                    closer = threading.Thread(target=ds.close)
                    closer.start()
                    closer.join(30)
        assert len(got) == 8 and set(got) <= set(items.values())
        assert loader.epoch_stats[-1].complete is False
        assert ds._state is None
        wait_until(lambda: not _state_threads(), "the state's threads gone", 10)
        loader.close()
        loader.close()
        ds.close()
    finally:
        srv.kill()
