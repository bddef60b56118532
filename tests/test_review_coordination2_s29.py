"""Review of the job's side of the manager (clients/coordination.py) with real cachemanager and
cacheserver processes on loopback: chunk releases stay right when the manager re-chunks the
dataset mid-epoch (restarted on its state dir with another --chunk-size or --budget: a new
DoubleBuffer), and close() stops the coordination thread promptly while it prefetches from a
slow store, leaving nothing of the dataset's process state behind."""
import contextlib
import os
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from manager.policy.chunks import chunk_members  # noqa: E402
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until  # noqa: E402
from test_dataset import make_dataset  # noqa: E402

JOB = "rechunk"
N = 100  # items of 10 kB: 1 MB


def _members(c: int, k: int) -> set[int]:
    return {i for r in chunk_members(c, N, k) for i in r}


@pytest.fixture
def rechunk(tmp_path, monkeypatch):
    """A 1 MB dataset of 100 items registered as job JOB with a chunked plan (500 kB budget);
    yields (dataset, restart) where restart(*flags) restarts the manager on its state dir and
    port with other flags and waits until the job's plan is the new one's. The coordinator's
    thread is not started: the test drives it."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    port, state = free_port(), str(tmp_path / "m")
    box = [cachemanager(state, port, "--chunks", "--budget", "500kB", "--chunk-size", "100kB").start()]
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", box[0].address).start()
    ds = None
    try:
        wait_ring(box[0].address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=N, lo=10_000, hi=10_000)
        ds = CachedDataset(path, manager=box[0].address, job=JOB)
        coord = ds.coordinator
        assert (coord.plan.option, coord.plan.k, coord.plan.chunks) == ("chunked", 10, (0,))

        def restart(*flags: str, until) -> None:
            assert box[0].stop() == 0
            box[0] = cachemanager(state, port, "--chunks", *flags).start()

            def fetched():
                coord._take_plan(lambda: coord.client.get_plan(coord.dataset, JOB))
                return until(coord.plan)
            wait_until(fetched, "the restarted manager's plan", 20)
        yield ds, restart
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        box[0].kill()


def _manager_chunks(ds) -> tuple[int, ...]:
    """The chunks the manager lists for the job now (not the coordinator's copy)."""
    with ManagerClient(ds.coordinator.client.address, timeout=2) as mc:
        mc.set_job_token(JOB, ds.coordinator.client.job_token(JOB))
        return mc.get_plan(ds.coordinator.dataset, JOB).chunks


def test_counts_of_the_old_chunking_do_not_release_a_chunk_of_the_new_one_unread(rechunk):
    """Items read under k=10 were counted under their chunk number; the manager re-chunked to
    k=20 and new chunk 0 (other items, fewer of them) counted as read to its end: it was
    released before one of its items was read."""
    ds, restart = rechunk
    coord = ds.coordinator
    read = sorted(_members(0, 10) - _members(0, 20))  # old chunk 0's items that new chunk 0 lacks
    assert len(read) >= len(_members(0, 20))
    coord.consumed(read)  # fewer than old chunk 0 holds: nothing released
    assert _manager_chunks(ds) == (0,)
    restart("--budget", "500kB", "--chunk-size", "50kB", until=lambda p: p.k == 20 and p.chunks == (0,))
    other = min(_members(5, 20) - set(read))
    coord.consumed([other])  # the next batch: new chunk 0 still has all of its items unread
    assert coord.plan.chunks == (0,)
    assert _manager_chunks(ds) == (0,)
    coord.consumed(sorted(_members(0, 20)))  # read to its end now: released
    assert 0 not in _manager_chunks(ds)


def test_a_chunk_released_under_the_old_chunking_is_released_again_under_the_new_one(rechunk):
    """Chunk 0 released under k=10 stayed "released" for the rest of the epoch: the manager
    re-chunked (k=20), the job read all of new chunk 0 and never released it, holding the
    rotation until the epoch ended."""
    ds, restart = rechunk
    coord = ds.coordinator
    old0 = _members(0, 10)
    coord.consumed(sorted(old0))
    wait_until(lambda: 0 not in _manager_chunks(ds), "chunk 0 released under k=10", 20)
    restart("--budget", "500kB", "--chunk-size", "50kB", until=lambda p: p.k == 20 and p.chunks == (0,))
    coord.consumed(sorted(_members(0, 20) - old0))  # new chunk 0 is now read to its end
    assert 0 not in coord.plan.chunks
    assert 0 not in _manager_chunks(ds)


def test_a_chunk_released_before_a_new_buffer_of_the_same_chunking_is_released_again(rechunk):
    """The budget shrank below two chunks (no plan) and grew back: a new DoubleBuffer of the same
    k hands chunk 0 out again. This epoch's items of it are all read, so it is released at the
    next batch, not held until the epoch ends."""
    ds, restart = rechunk
    coord = ds.coordinator
    coord.consumed(sorted(_members(0, 10)))
    wait_until(lambda: 0 not in _manager_chunks(ds), "chunk 0 released", 20)
    restart("--budget", "150kB", "--chunk-size", "100kB", until=lambda p: p.option == "none")
    restart("--budget", "500kB", "--chunk-size", "100kB",
            until=lambda p: p.option == "chunked" and p.chunks == (0,))
    coord.consumed([min(_members(3, 10))])
    assert 0 not in _manager_chunks(ds)


def test_items_read_under_a_full_plan_count_once_the_dataset_is_chunked(rechunk):
    """Items read while the plan was full (or none) were not counted at all: once the manager
    chunked the dataset, a chunk whose items this epoch had already read was never released."""
    ds, restart = rechunk
    coord = ds.coordinator
    restart("--budget", "150kB", "--chunk-size", "100kB", until=lambda p: p.option == "none")
    coord.consumed(sorted(_members(0, 10)))  # read while the dataset has no plan of its own
    restart("--budget", "500kB", "--chunk-size", "100kB",
            until=lambda p: p.option == "chunked" and p.chunks == (0,))
    coord.consumed([min(_members(3, 10))])
    assert 0 not in _manager_chunks(ds)


def _store_threads() -> list[threading.Thread]:
    """Live threads of a dataset's process state (its store-read pool)."""
    return [t for t in threading.enumerate() if t.name.startswith("store-fetch")]


@contextlib.contextmanager
def slow_chunked(tmp_path, monkeypatch):
    """A chunked dataset (1000 items of 1 kB: chunk 0 of 10 is 100 items, 100 kB) read from an
    object store capped at 10 kB/s (the chunk 10 s, a prefetch part of PREFETCH_PART = 16 items
    1.6 s, past the store's first 16 KiB burst), under a real manager and server; yields
    (dataset, store, server). Its coordinator reports every 0.1 s and prefetches the whole
    loading chunk at once; the test starts its thread."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "500kB", "--chunk-size", "100kB").start()
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address).start()
    ds = None
    try:
        wait_ring(m.address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=1000, lo=1_000, hi=1_000)
        with objstore.ObjectStore(tmp_path / "ds", bandwidth="10kB") as store:
            d = Digest.load(path)
            d.root = store.url
            d.save(str(tmp_path / "http.digest"))
            ds = CachedDataset(str(tmp_path / "http.digest"), manager=m.address, job="slow")
            ds.coordinator.report_seconds = 0.1
            ds.coordinator.prefetch_bandwidth = 1e9  # the whole loading chunk in one prefetch
            yield ds, store, srv
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


def test_close_stops_a_thread_prefetching_from_a_slow_store_and_leaves_no_state(tmp_path, monkeypatch):
    """close() waited 5 s for the coordination thread, gave up while it prefetched the loading
    chunk from a slow store (one prefetch: up to 64 items), and closed the dataset's process state
    under it; the thread went on reading from the store. The thread now checks the stop between
    parts of a prefetch: close() returns once the part in hand is read, the thread is gone,
    the store is read no more, and no process state is left."""
    with slow_chunked(tmp_path, monkeypatch) as (ds, store, _):
        coord = ds.coordinator
        assert coord.plan.loading is not None and coord.plan.k == 10
        coord.start()
        wait_until(lambda: store.stats(by_path=False)["bytes_served"] > 0, "a prefetch reading the store", 15)
        t0 = time.monotonic()
        ds.close()
        took = time.monotonic() - t0
        thread = coord._thread
        assert took < 3.5, f"close() took {took:.1f} s"
        assert not thread.is_alive()
        served = store.stats(by_path=False)["bytes_served"]
        time.sleep(2.0)
        assert store.stats(by_path=False)["bytes_served"] == served  # nothing read after close
        assert ds._state is None and not _store_threads()
