"""Review (s31) of the job's side of the manager and of DDP (clients/coordination.py, batchreports.py,
ddpseed.py) with real processes: spawned DDP ranks sharing torch.distributed's store (gloo on
loopback), and a real cachemanager, cacheserver and bandwidth-capped object store."""
import datetime
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.ddpseed import check_same_seed  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import free_port, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)
W = 2


def _one(ds, how, batch_size, drop_last, seed):
    """'ok', or the ValueError's message, for one loader made as `how` says."""
    try:
        if how == "loader":
            ds.loader(batch_size, seed=seed, drop_last=drop_last)
        else:  # the check as the sampler makes it, told the loader's own arguments
            check_same_seed(ds.dataset_tag, seed, torch.distributed.get_rank(), W,
                            loader={"n_items": len(ds), "batch_size": batch_size, "drop_last": drop_last})
        return "ok"
    except ValueError as e:
        return str(e)


def _loaders_rank(rank, port, path, made, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ds = CachedDataset(path, cache=False)
        got = []
        for turn in range(W):  # rank 0 makes all its loaders first: which rank raises is known
            if rank == turn:
                got = [_one(ds, *m) for m in made[rank]]
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
        ds.close()
    finally:
        dist.destroy_process_group()


def _ranks(tmp_path, made):
    path = write_files_digest(tmp_path / "ds", (os.urandom(64) for _ in range(20)))
    run_ranks(_loaders_rank, (free_port(), path, made, str(tmp_path)), W)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(W)]


@pytest.mark.parametrize("how", ["check", "loader"])
def test_ddp_loaders_made_in_another_order_are_paired_by_their_arguments(tmp_path, how):
    """A train loader (batch 4, drop_last) and a val loader (batch 8) of one dataset, made in
    opposite orders by the two ranks with the same seeds each: the k-th of each rank was
    paired, so rank 1 was told its seeds differ ("rank 1 seed=2, rank 0 seed=1") and could not
    train. Loaders are now paired by the dataset and their own arguments."""
    train, val = (how, 4, True, 1), (how, 8, False, 2)
    assert _ranks(tmp_path, [[train, val], [val, train]]) == [["ok", "ok"], ["ok", "ok"]]


@pytest.mark.parametrize("how", ["check", "loader"])
def test_ddp_seeds_swapped_between_loaders_are_found(tmp_path, how):
    """Rank 1 passes the train loader's seed to its val loader and the val loader's to its
    train loader, and makes them in the other order: paired by creation order, the seeds
    matched (1 with 1, 2 with 2) and both loaders split different permutations silently."""
    r0, r1 = _ranks(tmp_path, [[(how, 4, True, 1), (how, 8, False, 2)], [(how, 8, False, 1), (how, 4, True, 2)]])
    assert r0 == ["ok", "ok"]
    assert "rank 1 seed=1, rank 0 seed=2" in r1[0] and "rank 1 seed=2, rank 0 seed=1" in r1[1], r1


def test_ddp_loaders_equal_but_for_the_seed_are_still_paired_in_order(tmp_path):
    """Nothing but creation order tells apart loaders that differ only in their seed: the
    k-th of each rank still pair (the earlier behaviour, which existing jobs rely on)."""
    r0, r1 = _ranks(tmp_path, [[("check", 4, False, 5), ("check", 4, False, 7)],
                               [("check", 4, False, 5), ("check", 4, False, 8)]])
    assert r0 == ["ok", "ok"] and r1[0] == "ok" and "rank 1 seed=8, rank 0 seed=7" in r1[1], r1


def test_ddp_seed_check_refuses_loader_arguments_that_no_two_ranks_could_agree_on():
    with pytest.raises(TypeError, match="loader arguments for the DDP seed check"):
        check_same_seed("ab", 0, 0, 1, loader={"collate": object()})


def _in(thread, name: str) -> bool:
    """Whether `thread` is running function `name` now (its stack, as Python sees it)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def test_a_coordination_step_outliving_close_makes_no_manager_call_after_it(tmp_path, monkeypatch, caplog):
    """close() gave up waiting for the coordination thread while its load report sampled the
    chunk on a cache server that did not answer (stopped: the look-up waits out its 30 s
    deadline), then unregistered the job and closed the manager client. The look-up answered
    later and the thread sent its load report through the closed client anyway: "cache
    coordination step failed" with a ValueError traceback on the user's stderr, after close()
    (and, had the call come between close()'s unregister and the client's close, the manager
    would have answered NOT_FOUND and the thread registered the job again: a job nobody runs,
    holding its cache share until it expired). The thread now ends without a manager call."""
    import logging
    import signal

    from clients import coordination
    from procs import sigstop, wait_until
    from test_review_coordination2_s29 import slow_chunked

    monkeypatch.setattr(coordination, "CLOSE_WAIT_S", 0.5)
    with slow_chunked(tmp_path, monkeypatch) as (ds, store, srv):
        coord = ds.coordinator
        coord.prefetch_bandwidth = 0  # no store reads: the step is its reports and look-ups
        calls, real = [], coord.client._call

        def watched(method, *a, **kw):  # the real call: this only notes which were made
            calls.append(method)
            return real(method, *a, **kw)
        monkeypatch.setattr(coord.client, "_call", watched)
        coord.start()
        sigstop(srv.pid)
        try:
            wait_until(lambda: _in(coord._thread, "_report_loaded") and _in(coord._thread, "lookup"),
                       "the load report's look-up waiting on the stopped server", 60)
            with caplog.at_level(logging.WARNING, logger="mlcache.client"):
                ds.close()
                assert coord._thread.is_alive()  # the case under review
                made = len(calls)
                os.kill(srv.pid, signal.SIGCONT)
                coord._thread.join(40)
                assert not coord._thread.is_alive()
        finally:
            os.kill(srv.pid, signal.SIGCONT)
    assert calls[made:] == [], calls[made:]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text



def exit_handlers_took(p: subprocess.CompletedProcess, ended: float) -> float:
    """Seconds from close() returning to the end of the exit handlers of an _EXIT_AFTER_CLOSE
    run that ended (monotonic) at `ended`. What close_after promises is that bound: its wait,
    then the broken-off reads' end. The interpreter's teardown after them (torch loaded: 2-5 s
    on a loaded 2-core host) is no wait of ours: bounded only below the slow read's 30 s."""
    assert p.returncode == 0, p.stderr
    assert "in a store read: True" in p.stdout, p.stdout
    closed = float(p.stdout.split("closed at")[1].split()[0])
    done = float(p.stdout.split("exit handlers done at")[1].split()[0])
    assert ended - closed < 30.0, f"exited {ended - closed:.1f} s after close() returned"
    return done - closed


_EXIT_AFTER_CLOSE = """
import atexit, sys, time
# registered before any other: runs after them all, close_after's wait included (atexit is LIFO)
atexit.register(lambda: print("exit handlers done at", time.monotonic(), flush=True))
sys.path.insert(0, sys.argv[3])
from clients import coordination
from test_review_clients_s31 import _in
coordination.CLOSE_WAIT_S = 0.5
from clients.dataset import CachedDataset
ds = CachedDataset(sys.argv[1], manager=sys.argv[2], job="slow")
coord = ds.coordinator
coord.report_seconds, coord.prefetch_bandwidth = 0.1, 1e9
coord.start()
deadline = time.monotonic() + 60
while not _in(coord._thread, "read_items") and time.monotonic() < deadline:
    time.sleep(0.05)
ds.close()
print("in a store read:", _in(coord._thread, "read_items"), flush=True)
print("closed at", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("latency", ["4s", "30s"])
def test_a_process_exiting_right_after_close_amid_a_slow_prefetch_part_ends_it_quietly(tmp_path, latency):
    """close() returned while a prefetch part still waited on a store whose reads take 4 s (or
    30 s), and the process exited at once: the exit closed the store's HTTP session under the
    read (fsspec's finalizer), the daemon coordination thread ran on into the interpreter's
    finalization and printed "cache coordination step failed" with a traceback (about one exit
    in eight; at times the process aborted, status -6), and the part's items were read for
    nothing. The exit now waits for the part at most EXIT_WAIT_S (4 s: its items are cached),
    then breaks its reads off and lets the thread give up their claims and end (30 s: no item
    is left claimed); nothing is printed."""
    import time

    from clients.digest import Digest
    from clients.jobtokenfile import DIR_ENV
    from clients.procstate import BROKEN_WAIT_S, EXIT_WAIT_S
    from procs import cachemanager, cacheserver, wait_ring
    from test_dataset import make_dataset

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import objstore

    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "500kB", "--chunk-size", "100kB").start()
    srv = cacheserver(str(tmp_path / "srv"), "64MB", 0, "--manager", m.address, "--claim-ttl", "60").start()
    try:
        wait_ring(m.address, 1)
        path, _ = make_dataset(tmp_path / "ds", n=1000, lo=1_000, hi=1_000)
        with objstore.ObjectStore(tmp_path / "ds", latency=latency) as store:
            d = Digest.load(path)
            d.root = store.url
            d.save(str(tmp_path / "http.digest"))
            env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       PYTHONFAULTHANDLER="1")
            env[DIR_ENV] = str(tmp_path / "tokens")
            p = subprocess.run([sys.executable, "-c", _EXIT_AFTER_CLOSE, str(tmp_path / "http.digest"), m.address,
                                os.path.dirname(os.path.abspath(__file__))],
                               capture_output=True, text=True, timeout=120, env=env)
            ended = time.monotonic()
            read = [int(p_.rsplit("img", 1)[1][:5]) for p_, e in store.stats()["by_path"].items()
                    if p_.endswith(".bin") and e["bytes"] >= 1000]
            check = CachedDataset(str(tmp_path / "http.digest"), cache=srv.address, job="other")
            try:
                codes = check.lookup_codes(list(range(1000)))
                cached = check.lookup(read)
            finally:
                check.close()
    finally:
        srv.kill()
        m.kill()
    took = exit_handlers_took(p, ended)
    assert took < EXIT_WAIT_S + BROKEN_WAIT_S + 2.0, f"exit handlers ran {took:.1f} s after close()"
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr
    assert codes.count(2) == 0, f"{codes.count(2)} items left claimed by the exited job"  # vocab.PENDING
    if latency == "4s":
        assert read and all(cached), f"of the {len(read)} items read after close(), {sum(cached)} were cached"
