"""Review of the job's side of the manager (clients/coordination.py) with a real cachemanager
and cacheserver on loopback: a job the manager forgot is registered again even while it queues
no batch reports, and a pipeline report that reached no manager is sent again."""
import logging
import os
import signal
import time

import pytest

pytest.importorskip("torch")

from clients.dataset import CachedDataset  # noqa: E402
from clients.jobtokenfile import DIR_ENV  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until  # noqa: E402
from test_dataset import make_dataset  # noqa: E402
from test_policy_autocache import costs  # noqa: E402

# 1 MB in 100 items over 100 kB chunks, 300 kB of room: a chunked plan of 10 chunks
CHUNKS = ("--chunks", "--budget", "300kB", "--chunk-size", "100kB")
FP = "7a" * 32


def _jobs(address, job, token):
    """The jobs the manager at ``address`` lists, seen with ``job``'s token."""
    with ManagerClient(address, timeout=2) as mc:
        mc.set_job_token(job, token)
        return [j["job"] for j in mc.status_dict(wait=True)["jobs"]]


@pytest.fixture
def chunked_job(tmp_path, monkeypatch):
    """A dataset registered as job "idle" on a chunked plan, its coordinator's thread
    running, under a cluster token (as a deployment with roles runs: only jobs and the
    manager's role act); yields (dataset, restart), restart() replacing the manager by one
    on an empty state dir at the same address (it knows no job), and returning its address."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    tok = tmp_path / "cluster.token"
    tok.write_text("0123456789abcdef0123456789abcdef\n")
    tok.chmod(0o600)
    secured = (*CHUNKS, "--cluster-token-file", str(tok))
    port = free_port()
    procs = [cachemanager(str(tmp_path / "m1"), port, *secured).start()]
    procs.append(cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", procs[0].address,
                             "--cluster-token-file", str(tok)).start())
    ds = None
    try:
        wait_ring(procs[0].address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=100, lo=10_000, hi=10_000)
        ds = CachedDataset(path, manager=procs[0].address, job="idle")
        coord = ds.coordinator
        assert coord.plan.option == "chunked" and coord.plan.chunks and coord.plan.loading is not None
        coord.report_seconds = coord.quiet_report_seconds = 0.2
        coord.start()

        def restart():
            procs[0].kill()
            procs[0] = cachemanager(str(tmp_path / "m2"), port, *secured).start()
            return procs[0].address

        yield ds, restart
    finally:
        if ds is not None:
            ds.close()
        for p in procs:
            p.kill()


def test_a_forgotten_job_with_no_batches_queued_registers_again_after_a_refused_release(chunked_job, caplog):
    """A chunk release answered NOT_FOUND (the manager forgot the job) said "the coordinator's
    thread registers again"; that thread did so only when a batch report of its own was
    answered NOT_FOUND, and with no batch queued (a pause between epochs) it sent none."""
    ds, restart = chunked_job
    coord = ds.coordinator
    address = restart()
    c = coord.plan.chunks[0]
    members = [i for r in coord.plan.members(c) for i in r]
    caplog.set_level(logging.WARNING, "mlcache.client")

    sent = []  # the chunk's items, read once; later tries release on an empty batch

    def refused_release():
        coord._release_after = 0.0  # the manager may still be reconnecting: try again at once
        coord.consumed([] if sent else members)
        sent.append(True)
        return any(f"releasing chunk {c} failed" in r.getMessage() for r in caplog.records)

    wait_until(refused_release, "the release answered by the restarted manager", 15)
    token = coord.client.job_token("idle")
    wait_until(lambda: "idle" in _jobs(address, "idle", token), "the job registered again", 10)


def test_a_forgotten_idle_job_loading_a_chunk_registers_again(chunked_job):
    """With no batches to report, the thread's only call was its load report, which the
    manager refuses (PERMISSION_DENIED: no such job on the dataset) once it forgot the job:
    it was refused every step and never registered again."""
    ds, restart = chunked_job
    coord = ds.coordinator
    address = restart()
    token = coord.client.job_token("idle")
    wait_until(lambda: "idle" in _jobs(address, "idle", token), "the job registered again", 15)
    # and its chunk plan is the new manager's
    wait_until(lambda: coord.plan.option == "chunked", "a plan from the new manager", 10)


def test_a_pipeline_report_that_reached_no_manager_is_sent_again(tmp_path, monkeypatch):
    """A pipeline report that failed only because the manager did not answer in time (it
    still has the job) was never sent again: the manager never counted the job on its
    pipeline (nor its transformed set)."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    m = cachemanager(str(tmp_path / "m")).start()
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address).start()
    ds = None
    try:
        wait_ring(m.address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=60)
        ds = CachedDataset(path, manager=m.address, job="piped")
        coord = ds.coordinator
        coord.report_seconds = coord.quiet_report_seconds = 0.2
        coord.start()
        os.kill(m.pid, signal.SIGSTOP)  # up, but answering nothing: calls run out their deadline
        try:
            got = coord.autocache_decision(ds.dataset_tag, FP, costs(items=60, prefix_s=0.008))
        finally:
            os.kill(m.pid, signal.SIGCONT)
        assert got is None  # the job decides alone meanwhile

        def counted():
            with ManagerClient(m.address, timeout=2) as mc:
                mc.set_job_token("piped", coord.client.job_token("piped"))
                pipes = mc.status_dict().get("pipelines", [])
            return pipes and "piped" in pipes[0]["decision"]["jobs"]

        wait_until(counted, "the pipeline report sent again", 10)
        time.sleep(0.6)  # sent once: nothing is left to send again
        assert not coord._unsent
    finally:
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()
