"""Review of the job's side of the manager (clients/coordination.py) with real cachemanager
(and cacheserver) processes on loopback: batch times measured while the manager is down, or
while it no longer knows the job, reach it once it answers again (its benefit regression
needs them), exactly once; and a plan fetched before a chunk release never replaces the
release's answer."""
import threading
import time

import pytest

pytest.importorskip("torch")

from clients.dataset import CachedDataset  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from manager.manager_client import ManagerClient, ManagerUnavailable  # noqa: E402
from procs import batches_counted, cachemanager, cacheserver, free_port, wait_ring, wait_until  # noqa: E402
from test_dataset import make_dataset  # noqa: E402

# 1 MB in 100 items over 100 kB chunks, 300 kB of room: a chunked plan of 10 chunks
CHUNKS = ("--chunks", "--budget", "300kB", "--chunk-size", "100kB")


def _failed_reports(coord) -> list:
    """The codes of the coordinator's batch reports that failed, as they happen (the real
    call runs: this only watches it)."""
    codes, real = [], coord.client.report_batches

    def watched(job, batches):
        try:
            return real(job, batches)
        except Exception as e:
            codes.append(getattr(e, "code", None))
            raise
    coord.client.report_batches = watched
    return codes


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A dataset registered as job "outage" with a manager (no cache server: cache=False), its
    coordinator reporting every 0.2 s; yields (dataset, manager daemon, port)."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    port = free_port()
    m = cachemanager(str(tmp_path / "m1"), port).start()
    path, _ = make_dataset(tmp_path / "ds", n=20, seed=3)
    ds = CachedDataset(path, cache=False, manager=m.address, job="outage")
    box = [m]
    try:
        ds.coordinator.report_seconds = ds.coordinator.quiet_report_seconds = 0.2
        yield ds, box, port
    finally:
        ds.close()
        box[0].kill()


def _queue(coord, n: int, duration: float = 0.05) -> None:
    now = time.time()
    for b in range(n):
        coord.batch_time(now - (n - b) * duration, duration)


def test_batches_reported_while_the_manager_is_down_reach_it_once_it_is_back(job, tmp_path):
    """A report that reached no manager (UNAVAILABLE) was dropped: every batch measured during a
    manager outage or restart was lost to its benefit regression. They are kept and sent once
    it answers again, and counted once."""
    ds, box, port = job
    coord = ds.coordinator
    _queue(coord, 30)
    coord.start()
    wait_until(lambda: batches_counted(box[0].address, "outage") == 30, "the first 30 batches counted", 10)
    failed = _failed_reports(coord)
    assert box[0].stop() == 0  # SIGTERM: it drains and exits, its state dir kept
    _queue(coord, 40)
    # the thread tried to report them while nothing listened
    wait_until(lambda: any(c is not None and c.name == "UNAVAILABLE" for c in failed),
               "a batch report refused for want of a manager", 10)
    box[0] = cachemanager(str(tmp_path / "m1"), port).start()  # the same state dir: it knows the job
    wait_until(lambda: batches_counted(box[0].address, "outage") == 70, "the 40 batches of the outage counted", 15)
    time.sleep(1.0)  # five more report periods: none is sent twice
    assert batches_counted(box[0].address, "outage") == 70
    assert not coord.reports.queued


def test_close_reports_every_queued_batch(job):
    """close() sent one last report of at most REPORT_MAX (1000) batches: the rest of the
    queue (a slow manager, an outage just over) never reached the manager."""
    from clients.batchreports import REPORT_MAX

    ds, box, port = job
    coord = ds.coordinator
    sent, real = [], coord.client.report_batches

    def counted(j, batches):
        reply = real(j, batches)  # the real call: this only counts what the manager answered
        sent.append(len(batches))
        return reply
    coord.client.report_batches = counted
    _queue(coord, 2 * REPORT_MAX + 500)
    ds.close()  # never started: close() sends them all
    assert sum(sent) == 2 * REPORT_MAX + 500 and len(sent) == 3
    assert not coord.reports.queued


def test_batches_refused_for_an_unknown_job_reach_the_manager_after_it_registers_again(job, tmp_path):
    """A manager restarted on an empty state dir answers the report NOT_FOUND without applying
    it; the job registers again, and the batches of that report went nowhere."""
    ds, box, port = job
    coord = ds.coordinator
    coord.start()
    box[0].kill()
    box[0] = cachemanager(str(tmp_path / "m2"), port).start()  # it knows no job
    failed = _failed_reports(coord)
    _queue(coord, 25)
    wait_until(lambda: batches_counted(box[0].address, "outage") == 25, "the batches counted after registering again", 15)
    assert any(c is not None and c.name == "NOT_FOUND" for c in failed)  # the path this test is about
    time.sleep(1.0)
    assert batches_counted(box[0].address, "outage") == 25


def test_a_full_queue_keeps_the_newest_batches_when_a_failed_report_is_put_back(job):
    """Put back in front of the batches queued during the failed call, in order; over the queue's
    bound the oldest go first (the thread is not started: this drives its step by hand)."""
    ds, box, _ = job
    coord = ds.coordinator
    box[0].kill()
    size = coord.reports.queued.maxlen
    for b in range(size):
        coord.batch_time(float(b), 0.01)
    real = coord.client.report_batches

    def during(job_name, batches):  # the training loop hands over 500 more meanwhile
        for b in range(size, size + 500):
            coord.batch_time(float(b), 0.01)
        return real(job_name, batches)
    coord.client.report_batches = during
    with pytest.raises(ManagerUnavailable):
        coord._report()
    assert [b[0] for b in coord.reports.queued] == [float(b) for b in range(500, size + 500)]


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A dataset registered as job "racer" on a chunked plan (a manager and a server); the
    coordinator's thread is not started."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    m = cachemanager(str(tmp_path / "m"), 0, *CHUNKS).start()
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address).start()
    ds = None
    try:
        wait_ring(m.address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=100, lo=10_000, hi=10_000)
        ds = CachedDataset(path, manager=m.address, job="racer")
        assert ds.coordinator.plan.option == "chunked" and ds.coordinator.plan.chunks
        assert ds.coordinator.plan.loading is not None
        yield ds
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


def test_a_load_report_answered_before_a_release_does_not_bring_the_released_chunk_back(chunked):
    """The thread's load report (its answer: the job's plan) and the training loop's chunk
    release ran at once; the load report's answer, fetched before the release, taken after it
    put the released chunk back into the plan at the same version: the job inserted under a
    chunk it gave up and never released the chunk it was moved to (no report fetched the plan
    again while the version stood)."""
    ds = chunked
    coord = ds.coordinator
    plan = coord.plan
    c = plan.chunks[0]
    answered, released = threading.Event(), threading.Event()
    real = coord.client.report_loaded

    def slow_reply(*a, **kw):  # the real call; its answer arrives late (after the release, if it can)
        got = real(*a, **kw)
        answered.set()
        released.wait(3)
        return got
    coord.client.report_loaded = slow_reply
    t = threading.Thread(target=coord._report_loaded, args=(plan, plan.loading))
    t.start()
    try:
        assert answered.wait(10)
        t0 = time.monotonic()
        coord.consumed([i for r in plan.members(c) for i in r])  # chunk c read to its end
        assert time.monotonic() - t0 < 1.0  # the training loop does not wait behind the load report
        released.set()
    finally:
        released.set()
        t.join(15)
    assert not t.is_alive()
    coord.consumed([])  # the next batch: the release the load report's call held off goes now
    with ManagerClient(ds.coordinator.client.address, timeout=2) as mc:
        mc.set_job_token("racer", coord.client.job_token("racer"))
        now = mc.get_plan(coord.dataset, "racer")
    assert c not in now.chunks  # the manager took the release
    assert (coord.plan.version, coord.plan.chunks) == (now.version, now.chunks)
    assert coord.plan.waiting == now.waiting
