"""Review of the local preprocessing workers (preprocess/pool.py, worker.py, engine.py,
codec.py) with real spawned workers: workers outliving a killed or forgetful loader,
close() racing a running epoch, an epoch kept open while the next one runs, counts that
made an epoch wait for ever, outputs that pickle in a worker but do not unpickle in the
loader, and transformed items the codec read back as something else."""
import collections
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, PipelineError  # noqa: E402
from preprocess.codec import decode, encode  # noqa: E402
from preprocess.engine import EpochPlan  # noqa: E402
from preprocess.fingerprint import Uncacheable  # noqa: E402
from preprocess.pool import PoolClosed, WorkerPool  # noqa: E402
from preprocess_steps import SleepOn, index_of  # noqa: E402
from procs import pid_alive  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Odd:
    """Pickles in the worker, but unpickling calls Odd(a): a TypeError in the loader."""

    def __init__(self, a, b):
        self.a = a

    def __reduce__(self):
        return (Odd, (self.a,))


def odd_on_5(i):
    return Odd(i, 0) if i == 5 else i


def _gone(procs, seconds):
    deadline = time.monotonic() + seconds
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p.pid for p in procs if p.is_alive()]


def pool_parent(digest):
    """Run in a subprocess: a pool of two idle workers; prints their pids, then waits to be killed."""
    ds = CachedDataset(digest, cache=False)
    pipeline = Pipeline([index_of])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    pool.resize(2)
    _both_working(pool, pipeline)  # idle in their task loop, not still starting, when killed
    print("PIDS", *[p.pid for p in pool.procs.values()], flush=True)
    time.sleep(120)


def _both_working(pool, pipeline):
    """Workers 0 and 1 each ran a task (started, and not still unpickling their arguments)."""
    for wid in (0, 1):
        pool.send(wid, ("task", 7, 0, pipeline.order, None, [(wid, False)]))
    got, deadline = [], time.monotonic() + 60
    while len(got) < 2 and time.monotonic() < deadline:
        got += pool.receive(0.1)
    assert sorted(m[3] for m in got if m[0] == "done") == [0, 1]


def test_workers_exit_when_the_loaders_process_is_killed(tmp_path):
    """Before: idle workers waited on their task queue for ever (they hold its write end
    themselves, so no end of file comes), orphaned under init."""
    digest = indexed_items(tmp_path / "ds", 4)
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {TESTS!r}]\n"
            f"from test_review_preprocess_workers import pool_parent\n"
            f"if __name__ == '__main__':\n    pool_parent({str(digest)!r})\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    pids = []
    try:
        line = parent.stdout.readline()
        assert line.startswith("PIDS "), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(map(pid_alive, pids))
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15
        while any(map(pid_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if pid_alive(p)], "workers outlived the killed loader"
    finally:
        parent.kill()
        parent.wait(10)
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_pool_dropped_without_close_stops_its_workers(tmp_path):
    """Before: a loader garbage-collected without close() left its workers (and their
    pipes) running until the interpreter exited."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 4), cache=False)
    pipeline = Pipeline([index_of])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    pool.resize(2)
    procs = list(pool.procs.values())
    try:
        _both_working(pool, pipeline)
        del pool
        gc.collect()
        assert _gone(procs, 10) == []
    finally:
        for p in procs:
            p.kill()
            p.join(5)
        ds.close()


def _loader(tmp_path, n, steps, **kw):
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False, transform=Pipeline([index_of, *steps]))
    return ds, ds.loader(4, num_workers=2, seed=0, cost_dir=False, **kw)


def test_close_while_an_epoch_runs_stops_the_workers_and_fails_the_epoch_clearly(tmp_path):
    """Before: close() raced the epoch's dispatcher thread: close() itself could raise
    OSError('handle is closed') (leaving workers running), and the kept iterator raised
    OSError on a closed or reused descriptor."""
    ds, loader = _loader(tmp_path, 64, [SleepOn(set(range(64)), 0.2)])  # 6 s of work: outlasts a pause before close()
    procs = list(loader.preprocess.pool.procs.values())
    try:
        it = iter(loader)
        next(it)
        loader.close()
        assert _gone(procs, 10) == []
        with pytest.raises(PoolClosed, match="close"):
            next(it)
        del it
        assert not [t for t in threading.enumerate() if t.name == "preprocess-dispatch"]
    finally:
        loader.close()
        ds.close()


def test_an_epoch_kept_open_does_not_hang_the_next_one(tmp_path):
    """An iterator kept after a few batches (next(it) for a fixed number of steps), then a
    new epoch. Before: the old epoch's dispatcher took the new one's messages and dropped
    them (another run's), and the new epoch waited for ever."""
    ds, loader = _loader(tmp_path, 64, [])
    try:
        it = iter(loader)
        for _ in range(3):
            next(it)
        got = []
        t = threading.Thread(target=lambda: got.extend(i for b in loader for i in b), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the second epoch hangs"
        assert Counter(got) == Counter(range(64))                # exactly once
        with pytest.raises(RuntimeError, match="abandoned"):   # not a silently short epoch
            next(it)
        assert sum(len(b) for b in loader) == 64                 # and the next epoch still runs
    finally:
        loader.close()
        ds.close()


def test_counts_that_would_send_no_task_are_refused(tmp_path):
    """Before: task_items=-1 sent no task and the epoch waited for ever; 2.5 workers or
    task_items a str failed on an unrelated comparison or slice."""
    with pytest.raises(ValueError, match="task_items must be an int >= 1, got -1"):
        EpochPlan(run=0, epoch=0, batch_size=4, order=(0,), task_items=-1)
    with pytest.raises(ValueError, match="prefetch_batches must be an int >= 1, got 0"):
        EpochPlan(run=0, epoch=0, batch_size=4, order=(0,), prefetch_batches=0)
    ds, loader = _loader(tmp_path, 16, [])
    try:
        with pytest.raises(ValueError, match="task_items must be an int >= 1 or None, got -1"):
            ds.loader(4, num_workers=2, cost_dir=False, task_items=-1)  # when made: no epoch to hang
        with pytest.raises(TypeError, match="must be an int, got 2.5"):
            loader.preprocess.pool.resize(2.5)
    finally:
        loader.close()
        ds.close()


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_output_that_does_not_unpickle_in_the_loader_is_the_items_error(tmp_path, on_error):
    """Before: a bare TypeError from unpickling ended the epoch, naming neither the item nor
    the step, whatever on_error said."""
    ds, loader = _loader(tmp_path, 16, [odd_on_5], on_error=on_error)
    try:
        if on_error == "raise":
            with pytest.raises(PipelineError, match=r"item 5 .*step 1 \(odd_on_5\).*cannot be unpickled"):
                list(loader)
        else:
            got = sorted(i for b in loader for i in b)
            assert got == [i for i in range(16) if i != 5]
            st = loader.epoch_stats[-1].preprocess
            assert st.skipped == 1 and "cannot be unpickled" in st.errors[0]
    finally:
        loader.close()
        ds.close()


def test_codec_stores_a_memoryview_by_its_bytes():
    """Before: its length was counted in items, so the payload did not decode."""
    a = np.arange(3, dtype=np.int32)
    assert decode(encode([memoryview(a), 1])) == [a.tobytes(), 1]
    assert decode(encode(memoryview(a.reshape(3, 1).astype(np.uint8)))) == bytes([0, 1, 2])


def test_codec_refuses_what_it_would_read_back_as_something_else():
    """Before: a namedtuple came back a plain tuple, a masked array without its mask, a
    structured array as raw bytes (np.void), a defaultdict a dict: a cache hit differed
    from the item computed."""
    point = collections.namedtuple("point", "x y")
    for bad in (point(1, 2), np.ma.array([1, 2], mask=[0, 1]),
                np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), collections.defaultdict(int, a=1),
                [np.zeros(1, dtype=[("a", "i4")])[0]]):
        with pytest.raises(Uncacheable):
            encode(bad)


def test_codec_keeps_numpy_scalars_that_subclass_python_ones():
    """Before: np.float64 (a float subclass) and np.str_ came back as float and str."""
    for x in (np.float64(2.5), np.str_("ab"), np.bytes_(b"x")):
        y = decode(encode(x))
        assert type(y) is type(x) and y == x


def test_codec_calls_every_malformed_payload_a_codec_error():
    """The transformed-item reader recomputes on CodecError only. Before: bad UTF-8, a
    dtype of no size, dimensions whose product wraps round in 64 bits or that numpy
    refuses, an image too large escaped as UnicodeDecodeError, ValueError, OverflowError."""
    from preprocess.codec import MAGIC, CodecError, _U32, _U64

    def array(dt, shape, nbytes=0):
        return (MAGIC + b"a" + bytes([len(dt)]) + dt + bytes([len(shape)]) + b"".join(map(_U64.pack, shape))
                + _U64.pack(nbytes))
    bad = [MAGIC + b"s" + _U64.pack(1) + b"\xff", array(b"<f8", (1 << 32, 1 << 32)), array(b"V0", (1,)),
           array(b"<f8", ((1 << 64) - 1, 0)),
           MAGIC + b"p" + bytes([3]) + b"RGB" + _U32.pack(1 << 31) + _U32.pack(1 << 31) + _U64.pack(0)]
    for payload in bad:
        with pytest.raises(CodecError):
            decode(payload)


@pytest.mark.parametrize("option", [{"timeout": 5}, {"persistent_workers": True}, {"prefetch_factor": 4}])
def test_dataloader_worker_options_with_a_transform_are_refused_by_name(tmp_path, option):
    """With a transform the per-sample scheduler runs the workers: a DataLoader worker option
    was ignored (timeout) or refused by torch in its own words (persistent_workers)."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False, transform=Pipeline([index_of]))
    try:
        with pytest.raises(ValueError, match=f"{next(iter(option))}: options of DataLoader worker processes"):
            ds.loader(4, num_workers=1, cost_dir=False, **option)
    finally:
        ds.close()


@pytest.mark.parametrize("option,why", [({"num_workers": "2"}, "num_workers must be an int"),
                                        ({"task_items": 0}, "task_items must be an int >= 1"),
                                        ({"task_items": "2"}, "task_items must be an int >= 1")])
def test_scheduler_counts_are_checked_when_the_loader_is_made(tmp_path, option, why):
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False, transform=Pipeline([index_of]))
    try:
        with pytest.raises(ValueError, match=why):
            ds.loader(4, cost_dir=False, **{"num_workers": 1, **option})
    finally:
        ds.close()
