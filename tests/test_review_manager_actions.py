"""The manager's action side (manager/actuator.py, manager/pipelines.py): defects found in
review, each reproduced with real cache server processes or the real state machine."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from cacheserver.client.server_client import ServerClient
from manager.actuator import Actuator, Desired
from manager.effects import ActivateChunk, RingChanged, SetMode

DS = "ab" * 16


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_calls_queued_before_a_server_left_do_not_land_after_its_rejoin_reconcile(server):
    """A server stops answering while decisions are queued for it, leaves the ring and
    comes back: the calls its old worker still held (decided first) must not reach it after
    the new worker's reconcile, which brought it to the newer state. Before the fix both
    workers ran at once, and the old SetMode(bypass) landed last: the server kept a job in
    bypass that the state had in normal mode (until the next reconcile round)."""
    ring, want = [server.address], Desired()  # desired: nobody in bypass
    act = Actuator(lambda: want, lambda: list(ring), timeout=0.5)
    try:
        act.reconcile()
        assert act.drain(5)
        os.kill(server.pid, signal.SIGSTOP)  # calls now wait out their 0.5 s deadline
        try:
            act.submit([ActivateChunk(DS, c) for c in range(60)] + [SetMode("j", "bypass", "probe")])
            time.sleep(0.2)
            ring.clear()
            act.submit([RingChanged(2, ())])  # it left the ring ...
        finally:
            os.kill(server.pid, signal.SIGCONT)
        ring.append(server.address)
        act.submit([RingChanged(3, (server.address,))])  # ... and is back; "j" is normal by now
        assert act.drain(20)
        name = f"actuator-{server.address}"
        deadline = time.monotonic() + 20
        while len(_threads(name)) > 1 and time.monotonic() < deadline:  # the old worker, done
            time.sleep(0.05)
        assert len(_threads(name)) == 1
        with ServerClient(server.address, use_dataplane=False) as c:
            assert dict(c.stats().job_modes) == {}
    finally:
        act.stop()



# ------------------------------------------------------------- autocache: a job registered again

def test_a_job_registered_again_is_not_counted_in_the_pipeline_its_last_run_reported():
    """A job's run reported a pipeline decided `transformed` (its gain moved to the
    transformed set), then left; a new run under the same name registers without that
    pipeline (another transform, or none). Before the fix the old measurement still counted
    it live: its gain stayed on the transformed set and its source dataset got no room at
    all (plan "none", no spare entries), so the new run cached nothing it read."""
    from cacheserver.vocab import transformed_tag
    from manager.model import ManagerConfig, ManagerModel
    from manager.policy.autocache import costs_to_dict
    from test_policy_autocache import costs

    src, fp, events = "cd" * 32, "ef" * 32, []
    m = ManagerModel(ManagerConfig(budget=4000 << 20))

    def ev(e: dict) -> None:
        events.append(e)
        m.apply(e)

    def register(job: str, t: float) -> None:
        ev({"type": "job_register", "job": job, "dataset": src, "dataset_bytes": 2000 * 128 * 1024,
            "n_items": 2000, "n_gpus": 1, "now": t})

    def report(job: str, t: float) -> None:
        c = costs_to_dict(costs(prefix_s=0.008))
        c.pop("room_bytes")
        ev({"type": "pipeline", "job": job, "dataset": src, "fingerprint": fp, "costs": c, "now": t})

    tag = transformed_tag(src, fp)
    register("train", 1.0)
    report("train", 2.0)
    assert m.pipelines[f"{src}/{fp}"].mode == "transformed" and src not in m.job_gains()
    ev({"type": "job_unregister", "job": "train", "now": 3.0})
    register("train", 4.0)  # the next run
    gains = m.job_gains()
    assert [g.job_id for g in gains[src]] == ["train"] and tag not in gains
    assert m.plan(src, "train")["option"] == "full" or m.plan(src, "train")["spare"]
    assert m.datasets[tag].idle_since == 3.0  # the transformed set is idle: its grace period runs
    snap = ManagerModel.from_dict(json.loads(json.dumps(m.to_dict())))  # a snapshot keeps that
    assert snap.digest() == m.digest() and tag not in snap.job_gains()
    report("train", 5.0)  # this run reports the pipeline: its gain moves again
    assert [g.job_id for g in m.job_gains()[tag]] == ["train"] and src not in m.job_gains()
    # journaled: a replay, and a snapshot of the state, give the same state
    m2 = ManagerModel(ManagerConfig(budget=4000 << 20))
    for e in events:
        m2.apply(e)
    assert m2.digest() == m.digest() == ManagerModel.from_dict(m.to_dict()).digest()


# ------------------------------------------------------------- a dataset forgotten while a server was away



def test_a_dataset_forgotten_while_its_server_was_away_does_not_stay_pinned_there(tmp_path):
    """A FULL dataset's chunk is active on a server (protected from eviction); the server
    stops answering and leaves the ring, and meanwhile the dataset's last job leaves and its
    grace period ends: the manager forgets it, its EvictDataset reaching no server. Before the
    fix the server, back in the ring, kept the dataset's entries pinned for ever (reconcile
    left datasets it does not know alone): room the budget counts as free, lost."""
    from manager.manager_client import ManagerClient
    from procs import cachemanager, cacheserver, wait_until

    ds = "ab" * 32
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "10MB", "--dataset-grace-seconds", "1").start()
    s = cacheserver(str(tmp_path / "s"), "16MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
    try:
        with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
            wait_until(lambda: len(mc.get_ring().addresses) == 1, "the server in the ring", 15.0)
            assert mc.register_job("j", ds, 1_000_000, 10).plan.option == "full"
            keys = [bytes([i]) * 32 for i in range(10)]
            sc.put([(k, b"x" * 1000) for k in keys], job="j", dataset=ds, chunk=0)
            mc.report_loaded(ds, 0, 1.0)
            wait_until(lambda: sc.stats().active_chunks.get(ds) == 0, "the active chunk on the server", 15.0)
            os.kill(s.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: not mc.get_ring().addresses, "the stopped server to leave the ring", 15.0)
                mc.unregister_job("j")
                wait_until(lambda: not mc.status_dict().get("datasets"), "the dataset forgotten", 15.0)
            finally:
                os.kill(s.pid, signal.SIGCONT)
            wait_until(lambda: len(mc.get_ring().addresses) == 1, "the server back in the ring", 15.0)
            wait_until(lambda: ds not in sc.stats().active_chunks, "the forgotten dataset's chunk unpinned", 20.0)
            assert sc.lookup(keys) == b"\0" * 10
    finally:
        s.kill()
        m.kill()


def test_an_unknown_dataset_keeps_its_active_chunk_through_the_grace_period(server):
    """A manager that lost its state finds chunks active that it does not know: jobs that
    register again within the grace period find them still cached; after it, they are unpinned."""
    with ServerClient(server.address, use_dataplane=False) as sc:
        sc.put([(b"k" * 32, b"v")], job="j", dataset=DS, chunk=2)
        sc.active_chunk(DS, 2)
        want = Desired(grace_s=60.0)
        act = Actuator(lambda: want, lambda: [server.address], timeout=2.0)
        try:
            act.reconcile()
            assert act.drain(5) and sc.stats().active_chunks.get(DS) == 2  # within its grace period
            want = Desired(option={DS: "full"}, grace_s=0.0)  # known (registered again): kept
            act.reconcile()
            assert act.drain(5) and sc.stats().active_chunks.get(DS) == 2
            want = Desired(grace_s=0.0)
            act.reconcile()
            assert act.drain(5) and DS not in sc.stats().active_chunks
        finally:
            act.stop()
