"""Review (s33): the loader statistics' cross-process locks (clients/stats.py, ownedlock.py)
when a process is killed holding one. A multiprocessing Lock stayed taken for good: every later
read counted for a loader waited out the pair lock's 5 s (every batch of every process, for the
dataset's life), and every new worker the row-claim lock's 30 s and then failed. A waiter now
takes over the lock of a holder that died (also a zombie: a killed child not reaped yet)."""
import multiprocessing
import os
import signal
import sys
import time

import pytest

from clients import stats
from clients.stats import LoaderCounters, SharedCounters, SharedRows, counting_for

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.timeout(240)


def _hold(lock, ready) -> None:
    assert lock.acquire(10)
    ready.set()
    time.sleep(120)  # killed holding it


def _killed_holding(lock, reap: bool):
    """A real process that took `lock` and was SIGKILLed; unreaped (a zombie) unless `reap`."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold, args=(lock, ready))
    p.start()
    assert ready.wait(60), "the holder never took the lock"
    os.kill(p.pid, signal.SIGKILL)
    if reap:
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
    else:  # dead, not reaped: kill(pid, 0) still finds it
        deadline = time.monotonic() + 30
        while not _zombie(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _zombie(p.pid)
    return p


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_a_pair_lock_left_by_a_killed_process_costs_reads_no_wait(reap):
    base = SharedCounters()
    mine = LoaderCounters(base)
    p = _killed_holding(base._pairs, reap)
    try:
        t0 = time.monotonic()
        with counting_for(mine):
            for _ in range(3):
                base.add(hits=1, store_bytes=10)
        totals, loaders = base.totals_with([mine])
        took = time.monotonic() - t0
    finally:
        p.join(30)
    assert took < stats.PAIR_WAIT_S, f"3 reads and an epoch's totals took {took:.1f} s (each waited the dead holder out)"
    assert totals["hits"] == loaders[mine]["hits"] == 3 and totals["store_bytes"] == 30
    t0 = time.monotonic()  # the lock is free again after: taken and released as usual
    with counting_for(mine):
        base.add(misses=1)
    assert time.monotonic() - t0 < 1.0 and mine.totals()["misses"] == 1


def test_a_row_claim_lock_left_by_a_killed_process_is_taken_over(monkeypatch):
    monkeypatch.setattr(stats, "CLAIM_WAIT_S", 10.0)  # the failing version fails sooner
    rows = SharedRows(2)
    p = _killed_holding(rows._claiming, reap=True)
    t0 = time.monotonic()
    rows.add({0: 5})  # this process's first add: it claims a row
    assert time.monotonic() - t0 < 5.0
    assert rows.sums() == [5, 0] and os.getpid() in rows._owners[:]
    assert p.exitcode == -signal.SIGKILL


def _die_holding_pairs(worker_id: int) -> None:
    """A DataLoader worker's start: it takes the dataset's pair lock, and is killed in it
    (as the OOM killer, or torch's terminate(), may end a worker mid-add)."""
    from torch.utils.data import get_worker_info

    assert get_worker_info().dataset.counters._pairs.acquire(10)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dataloader_worker_killed_in_the_pair_lock_slows_no_later_read(tmp_path):
    pytest.importorskip("torch")
    from clients.dataset import CachedDataset
    from filedigest import write_files_digest

    path = write_files_digest(tmp_path / "ds", (os.urandom(100) for _ in range(32)))
    ds = CachedDataset(path, cache=False)
    try:
        doomed = ds.loader(batch_size=8, num_workers=1, worker_init_fn=_die_holding_pairs)
        with pytest.raises(RuntimeError, match="DataLoader worker .* exited unexpectedly"):
            list(doomed)
        doomed.close()
        other = ds.loader(batch_size=8)  # reads in this process, each batch counted for it
        t0 = time.monotonic()
        assert sum(len(b) for b in other) == 32
        took = time.monotonic() - t0
        assert took < stats.PAIR_WAIT_S, f"an epoch of 4 batches took {took:.1f} s after the worker's death"
        st = other.epoch_stats[-1]
        assert (st.misses, st.items, st.complete) == (32, 32, True)
    finally:
        ds.close()


def _exited(pid: int, within: float) -> int | None:
    """The exit status of forked child `pid` within `within` s; None (it is killed) if it hangs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_mid_add_and_its_own_forked_child_count_on():
    """A DataLoader with multiprocessing_context='fork' forks its workers while another thread
    (the coordinator's prefetch) may be adding: the thread lock it held stayed held in the
    child, whose first read hung for good. A child's child claims a row of its own too."""
    rows = SharedRows(1)
    rows.add({0: 1})
    with rows._lock:  # as a thread mid-add at the fork
        pid = os.fork()
        if pid == 0:  # the child: counts, then forks a child that counts too
            code = 1
            try:
                rows.add({0: 1})
                grandchild = os.fork()
                if grandchild == 0:
                    rows.add({0: 1})
                    os._exit(0)
                code = 0 if _exited(grandchild, 20) == 0 else 2
            finally:
                os._exit(code)
    assert _exited(pid, 20) == 0, "the forked child never counted (hung on its parent's held lock)"
    owners = [p for p in rows._owners[:] if p]
    assert rows.sums() == [3] and len(owners) == len(set(owners)) == 3
