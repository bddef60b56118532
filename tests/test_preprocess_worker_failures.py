"""Workers that fail outside a step's ordinary exception, with real spawned workers:
an output that cannot be pickled, SystemExit or a BaseException in a step (in either of
a worker's threads), a worker exiting with status 0 without its exit message. Each ends
in an error naming the item and the cause, or in a death (items re-run, then
WorkerDied), never in an epoch waiting for ever. Loader runs go in a subprocess under a
time limit, so a hang fails the test instead of holding up the suite."""
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.pool import WorkerPool  # noqa: E402
from preprocess_steps import index_of  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(120)
LOADER_LIMIT_S = 60  # a loader run that has not ended by then hangs (each passes in a few seconds)


def in_worker() -> bool:
    """Steps below misbehave only in pool workers, not while the loader profiles in-process."""
    return multiprocessing.current_process().name.startswith("preprocess-")


class Boom(BaseException):
    pass


class Misbehave:
    """On the given indices, in a worker: 'lock' returns an output that cannot be pickled,
    'sys_exit' calls sys.exit(), 'base' raises a BaseException, 'exit0' ends the process
    with status 0 (os._exit), 'segv' kills it with SIGSEGV (a crashing decoder), 'sleep' takes
    0.3 s (the item moves to the background)."""

    def __init__(self, how, indices=None):
        self.how, self.indices = how, None if indices is None else frozenset(indices)

    def __call__(self, i):
        if not in_worker() or (self.indices is not None and i not in self.indices):
            return i
        if self.how == "lock":
            return (i, threading.Lock())
        if self.how == "sys_exit":
            sys.exit()
        if self.how == "base":
            raise Boom(f"boom on {i}")
        if self.how == "exit0":
            os._exit(0)
        if self.how == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(0.3)
        return i


def _receive_until(pool, want, seconds=15.0):
    got, deadline = [], time.monotonic() + seconds
    while not want(got) and time.monotonic() < deadline:
        got += pool.receive(0.1)
    return got


def test_background_failures_outside_a_step_exception_are_sent_as_item_errors(tmp_path):
    """Before: the background thread died on the unpicklable output and nothing came."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False)
    pipeline = Pipeline([index_of, Misbehave("lock", {3}), Misbehave("sys_exit", {4}), Misbehave("base", {5})])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    try:
        pool.resize(1)
        pool.send(0, ("task", 7, 0, pipeline.order, None, [(i, True) for i in (3, 4, 5, 6)]))
        got = _receive_until(pool, lambda g: len(g) >= 4)
        errors = {m[3]: (m[4], m[6].strip().splitlines()[-1]) for m in got if m[0] == "error"}
        assert errors[3][0] == 3 and "output cannot be pickled" in errors[3][1] and "_thread.lock" in errors[3][1]
        assert errors[4][0] == 2 and errors[4][1].startswith("SystemExit")
        assert errors[5][0] == 3 and "Boom: boom on 5" in errors[5][1]
        assert [m[3:5] for m in got if m[0] == "done"] == [(6, 6)]  # the thread went on
        assert pool.dead() == []
    finally:
        pool.close()
        ds.close()


def test_a_worker_that_exits_with_status_0_unasked_is_dead(tmp_path):
    """Before: dead() ignored status 0, so the items it held waited for ever."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False)
    pipeline = Pipeline([index_of, Misbehave("exit0", {5})])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    try:
        pool.resize(1)
        victim = pool.procs[0]
        pool.send(0, ("task", 7, 0, pipeline.order, None, [(3, False), (5, False)]))
        victim.join(30)
        assert victim.exitcode == 0
        got, deadline, dead = [], time.monotonic() + 15, []
        while not dead and time.monotonic() < deadline:
            got += pool.receive(0.1)
            dead = pool.dead()
        assert [m[:4] for m in got] == [("done", 7, 0, 3)] and dead == [0] and pool.size == 0
    finally:
        pool.close()
        ds.close()


def loader_outcome(digest: str, case: str) -> None:
    """Run in the subprocess: one epoch through a loader with one worker; prints the outcome."""
    steps = {"bg_lock": [Misbehave("sleep", {5}), Misbehave("lock", {5})],
             "lock_all": [Misbehave("lock")],
             "sys_exit": [Misbehave("sys_exit", {5})],
             "exit0_all": [Misbehave("exit0")],
             "segv_all": [Misbehave("segv")]}[case]
    ds = CachedDataset(digest, cache=False, transform=Pipeline([index_of, *steps]))
    loader = ds.loader(4, num_workers=1, seed=0, cost_dir=False)
    try:
        n = sum(len(b) for b in loader)
        print("OUTCOME finished", n, flush=True)
    except Exception as e:
        print("OUTCOME", type(e).__name__, str(e).splitlines()[0], flush=True)
    finally:
        loader.close()


def _run_loader(tmp_path, case: str) -> str:
    digest = indexed_items(tmp_path / "ds", 16)
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {TESTS!r}]\n"
            f"from test_preprocess_worker_failures import loader_outcome\n"
            f"loader_outcome({str(digest)!r}, {case!r})\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)  # its own group: a hang's workers go with it
    try:
        out, _ = p.communicate(timeout=LOADER_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"the loader hung ({case}): no outcome after {LOADER_LIMIT_S} s")
    lines = [ln for ln in out.splitlines() if ln.startswith("OUTCOME ")]
    assert lines, out[-3000:]
    return lines[-1]


def test_loader_names_an_unpicklable_output_from_the_background(tmp_path):
    """Item 5 moves to the background (0.3 s over the timeout), whose output is unpicklable.
    Before: the epoch waited for ever."""
    line = _run_loader(tmp_path, "bg_lock")
    assert line.startswith("OUTCOME PipelineError item 5 ") and "step 2 (Misbehave)" in line, line
    assert "output cannot be pickled" in line and "_thread.lock" in line, line


def test_loader_names_an_unpicklable_output_from_the_main_thread(tmp_path):
    """Before: 4 worker deaths and a WorkerDied that named no cause."""
    line = _run_loader(tmp_path, "lock_all")
    assert line.startswith("OUTCOME PipelineError item ") and "step 1 (Misbehave)" in line, line
    assert "output cannot be pickled" in line and "_thread.lock" in line, line


def test_loader_names_sys_exit_in_a_step(tmp_path):
    """Before: the worker exited with status 0 and the epoch waited for ever."""
    line = _run_loader(tmp_path, "sys_exit")
    assert line.startswith("OUTCOME PipelineError item 5 ") and "step 1 (Misbehave) raised SystemExit" in line, line


def test_loader_gives_up_on_workers_exiting_with_status_0(tmp_path):
    """Every worker ends itself (status 0) on its first item: replaced, then WorkerDied.
    Before: the epoch waited for ever."""
    line = _run_loader(tmp_path, "exit0_all")
    assert line.startswith("OUTCOME WorkerDied 4 preprocessing workers died"), line
    assert "exited with status 0 without being asked to stop" in line and "running item " in line, line


def test_loader_names_the_signal_and_the_item_a_worker_died_on(tmp_path):
    """Every worker crashes (SIGSEGV) on its first item. Before: WorkerDied said how many
    died and nothing of why, nor which item they were running."""
    line = _run_loader(tmp_path, "segv_all")
    assert line.startswith("OUTCOME WorkerDied 4 preprocessing workers died"), line
    deaths = line.split("giving up. ", 1)[1].split("; ")
    assert len(deaths) == 4 and all("was killed by SIGSEGV, running item " in d for d in deaths), line


@pytest.mark.parametrize("how, cause", [
    ("kill", "was killed by SIGKILL"), ("segv", "was killed by SIGSEGV"),
    ("exit0", "exited with status 0 without being asked to stop")])
def test_a_dead_workers_cause_and_item_are_named(tmp_path, how, cause):
    """Before: the pool knew a worker was dead, not how, nor what it was running."""
    from preprocess_steps import KillOn
    ds = CachedDataset(indexed_items(tmp_path / "ds", 8), cache=False)
    pipeline = Pipeline([index_of, KillOn({5}) if how == "kill" else Misbehave(how, {5})])
    pool = WorkerPool(ds, pipeline, job_seed=0)
    try:
        pool.resize(1)
        pool.send(0, ("task", 7, 0, pipeline.order, None, [(3, False), (5, False), (6, False)]))
        got, deadline, dead = [], time.monotonic() + 30, []
        while not dead and time.monotonic() < deadline:
            got += pool.receive(0.1)
            dead = pool.dead()
        assert dead == [0] and pool.deaths[0][0].startswith(cause) and pool.deaths[0][1] == [(5, 7)]  # (item, run)
        text = pool.death(0)
        assert text.startswith(f"worker 0 {cause}") and text.endswith(", running items [5]"), text
    finally:
        pool.close()
        ds.close()
