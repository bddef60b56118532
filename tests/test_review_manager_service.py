"""The manager service outside its policies (manager/service.py, actuator.py, managerd.py):
defects found in review, each reproduced with a real cachemanager and real cache servers."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time

import pytest

from cacheserver.client.server_client import ServerClient
from manager.actuator import Actuator, Desired
from manager.effects import EvictDataset, RingChanged
from manager.manager_client import ManagerClient
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until

A, B = "a1" * 16, "b2" * 16


def _keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def _server_of(m, tmp_path):
    """A cache server registered with manager m, its data plane on a free port."""
    return cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()


@contextlib.contextmanager
def _stopped(s):
    """The server frozen (SIGSTOP: it answers nothing) for the block's length."""
    os.kill(s.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s.pid, signal.SIGCONT)


@contextlib.contextmanager
def _threads_on_failure(m, log: str):
    """A wait in the block that fails shows the manager's threads (SIGUSR1: managerd's
    faulthandler dump, to its log) with the log's tail: where a stalled thread waits."""
    try:
        yield
    except AssertionError as e:
        with contextlib.suppress(ProcessLookupError):  # a manager that died: its log says why
            os.kill(m.pid, signal.SIGUSR1)
            time.sleep(1)
        with open(log, errors="replace") as f:
            tail = f.read()[-12000:]
        raise AssertionError(f"{e}; the manager's log, ending in its threads' stacks:\n{tail}") from e


def _full_dataset_on(mc: ManagerClient, sc: ServerClient, keys: list[bytes]) -> None:
    """Job j1 on A (200 kB): FULL; its entries (chunk 0, active: pinned) on the server."""
    assert mc.register_job("j1", A, 200_000, 20).plan.option == "full"
    sc.put([(k, b"v" * 10_000) for k in keys], dataset=A, chunk=0)
    mc.report_loaded(A, 0, 1.0)
    wait_until(lambda: sc.stats().active_chunks.get(A) == 0, "the active chunk on the server")


@pytest.mark.parametrize("call,restart", [("failed", False), ("failed", True), ("queued", True)])
def test_an_eviction_a_server_missed_in_a_re_plan_is_repeated_when_it_answers_again(tmp_path, call, restart):
    """A FULL dataset's entries (chunk 0, active: protected) are on a server that does not
    answer when a second job re-plans the dataset FULL -> CHUNKED: its EvictDataset times
    out. Reconcile sees chunk 0 resident in the new plan too, so before the fix the server
    kept the whole dataset pinned (200 kB where the plan allows 40 kB of it) until chunk 0
    turned over. With `restart`, the manager is killed (kill -9) and started again before
    the server answers: the missed eviction is journaled (manager/evictledger.py). "queued":
    killed while the call still waits (--server-timeout 30): an EvictDataset is owed from
    the moment it is queued, not only once its call failed."""
    timeout = "0.5" if call == "failed" else "30"
    args = ("--chunks", "--budget", "300kB", "--chunk-size", "100kB", "--heartbeat-misses", "100",
            "--server-timeout", timeout)
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port, *args).start()
    s = _server_of(m, tmp_path)
    keys = _keys(20, 1)
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc, ServerClient(s.address, use_dataplane=False) as sc:
            _full_dataset_on(mc, sc, keys)
            with _stopped(s):
                mc.register_job("j2", B, 250_000, 25, n_gpus=8)
                assert mc.get_plan(A, "j1").option == "chunked"
                log = str(tmp_path / "m" / "manager.log")
                if call == "failed":
                    with _threads_on_failure(m, log):
                        wait_until(lambda: "EvictDataset failed" in open(log).read(), "the EvictDataset to fail")
                if restart:
                    m.kill()
                    m = cachemanager(str(tmp_path / "m"), port, *args).start()
            with _threads_on_failure(m, log):
                wait_until(lambda: sc.lookup(keys) == b"\0" * 20, "the old plan's entries evicted", 15)
        if restart:
            assert m.stop() == 0  # paid is journaled too: the state written at exit owes nothing
            with open(tmp_path / "m" / "snapshot.json") as f:
                assert "owed" not in json.load(f)["state"]
    finally:
        s.kill()
        m.kill()


def test_a_re_plan_decided_as_the_manager_starts_reaches_a_server_out_of_the_ring_when_back(tmp_path):
    """The server left the ring (it stopped answering heartbeats); the manager restarts with a
    smaller --budget, which re-plans A FULL -> CHUNKED as it opens its state. The server
    comes back: before the fix it got no EvictDataset (the actuator learnt the servers the
    state knows only after the configure event), and A's old entries stayed pinned."""
    chunks = ("--chunks", "--chunk-size", "100kB")
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port, *chunks, "--budget", "300kB").start()
    s = _server_of(m, tmp_path)
    keys = _keys(20, 2)
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc, ServerClient(s.address, use_dataplane=False) as sc:
            _full_dataset_on(mc, sc, keys)
            with _stopped(s):
                wait_until(lambda: not mc.get_ring().addresses, "the server to leave the ring")
                assert m.stop() == 0
                m = cachemanager(str(tmp_path / "m"), port, *chunks, "--budget", "100kB").start()
                assert mc.get_plan(A, "j1").option == "chunked"
            wait_ring(m.address, 1)
            wait_until(lambda: sc.lookup(keys) == b"\0" * 20, "the old plan's entries evicted", 15)
    finally:
        s.kill()
        m.kill()


def test_an_eviction_decided_while_a_server_was_out_of_the_ring_reaches_it_when_back(server):
    """The server is out of the ring when a dataset is re-planned (no call reaches it);
    back, its old entries of the dataset go before it is brought to the new plan."""
    ring = [server.address]
    want = Desired(option={A: "chunked"}, resident={A: {0}}, active={A: 0})
    act = Actuator(lambda: want, lambda: list(ring), timeout=2.0)
    keys = _keys(5, 2)
    try:
        with ServerClient(server.address, use_dataplane=False) as sc:
            sc.put([(k, b"v" * 100) for k in keys], dataset=A, chunk=0)
            act.reconcile()
            assert act.drain(5) and sc.stats().active_chunks.get(A) == 0
            ring.clear()
            act.submit([RingChanged(2, ()), EvictDataset(A, "re-plan full -> chunked")])
            assert sc.lookup(keys) == b"\1" * 5  # not reached
            ring.append(server.address)
            act.submit([RingChanged(3, (server.address,))])
            assert act.drain(5)
            wait_until(lambda: sc.lookup(keys) == b"\0" * 5, "the missed eviction")
            assert sc.stats().active_chunks.get(A) == 0  # and then the current plan
            assert act.owed(server.address) == []
    finally:
        act.stop()


def test_a_restarted_cache_server_gets_the_plan_at_once(tmp_path):
    """A cache server restarts on its address with a new data dir (a new server id): it
    knows no job mode nor active chunk. Its registration is a join, but the ring's addresses
    do not change; before the fix it waited for the next reconcile round (here 60 s), a probed
    job's batches hitting the cache there meanwhile."""
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--bypass-probes", "--budget", "300kB",
                     "--chunk-size", "100kB", "--reconcile-seconds", "60").start()
    port, data = free_port(), str(tmp_path / "s")
    s = cacheserver(data, "64MB", port, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc:
            mc.register_job("j1", A, 200_000, 20)
            mc.report_loaded(A, 0, 1.0)
        with ServerClient(s.address, use_dataplane=False) as sc:
            wait_until(lambda: (st := sc.stats()).job_modes and st.active_chunks, "the plan on the server")
        s.kill()
        shutil.rmtree(data)
        s = cacheserver(data, "64MB", port, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
        with ServerClient(s.address, use_dataplane=False) as sc:
            st = wait_until(lambda: (st := sc.stats()).job_modes and st.active_chunks and st, "the plan again", 20.0)
            assert dict(st.job_modes) == {"j1": 1} and dict(st.active_chunks) == {A: 0}
    finally:
        s.kill()
        m.kill()


def test_unregistering_a_job_the_manager_does_not_know_journals_nothing(tmp_path):
    """Every rank of a job, a retry or a confused client unregistering a job that is gone:
    before the fix each call journaled (and fsynced) an event that changed nothing."""
    m = cachemanager(str(tmp_path / "m"), 0, "--decision-seconds", "60").start()  # no ticks journaled
    try:
        with ManagerClient(m.address) as mc:
            mc.register_job("j", A, 1000, 10)
            seq = mc.status().journal_seq
            mc.unregister_job("j")
            assert mc.status().journal_seq == seq + 1 and not mc.status().jobs
            for _ in range(20):
                mc.unregister_job("j")
                mc.unregister_job("nobody")
            assert mc.status().journal_seq == seq + 1
    finally:
        m.stop()


def test_sigusr1_writes_the_managers_threads_to_its_log_and_it_runs_on(tmp_path):
    """An operator's aid for a stalled manager (docs/operations.md): SIGUSR1 dumps every
    thread's stack to the log. Before, the signal's default action killed the manager."""
    m = cachemanager(str(tmp_path / "m"), 0).start()
    log = str(tmp_path / "m" / "manager.log")
    try:
        os.kill(m.pid, signal.SIGUSR1)
        # faulthandler writes thread by thread, the main thread's (waiting for SIGTERM in
        # run_until_signal) last: wait for it, not just for the first stacks.
        dump = wait_until(lambda: (t := open(log).read()).count("(most recent call first)") >= 2
                          and "in run_until_signal" in t and t, "the threads' stacks in the log", 10)
        assert "manager/decisions.py" in dump  # the decision loop's thread is among them
        with ManagerClient(m.address) as mc:
            mc.register_job("j", A, 1000, 10)  # still serving
        assert m.stop() == 0
    finally:
        m.kill()
