"""Review of the preprocessing pool's lock (preprocess/pool.py): a script that ends with an
epoch's iterator still open and its loader not closed must exit, and take its workers along."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from procs import pid_alive  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def keep_an_epoch_and_exit(digest):
    """Run in a subprocess: one batch of an epoch, then the end of the script, iterator kept."""
    from clients.dataset import CachedDataset
    from preprocess import Pipeline
    from preprocess_steps import SleepOn, index_of

    ds = CachedDataset(digest, cache=False, transform=Pipeline([index_of, SleepOn(set(range(64)), 0.05)]))
    loader = ds.loader(4, num_workers=2, seed=0, cost_dir=False)
    it = iter(loader)
    next(it)
    print("PIDS", *[p.pid for p in loader.preprocess.pool.procs.values()], flush=True)
    keep_an_epoch_and_exit.kept = (ds, loader, it)  # alive until the interpreter's teardown


def test_a_script_ending_mid_epoch_without_close_exits(tmp_path):
    """Before: at exit the pool's finalizer stopped the workers while the epoch's dispatcher
    still ran; it replaced them (a 'dictionary changed size' traceback, workers spawned at
    exit) and, frozen with the interpreter's daemon threads while it held the pool's lock,
    left the iterator's finalization waiting for that lock for ever: the script never ended."""
    digest = indexed_items(tmp_path / "ds", 64)
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {TESTS!r}]\n"
            f"from test_review_preprocess_exit import keep_an_epoch_and_exit\n"
            f"if __name__ == '__main__':\n    keep_an_epoch_and_exit({str(digest)!r})\n")
    script = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        line = script.stdout.readline()
        assert line.startswith("PIDS "), line + script.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        try:
            _, err = script.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the script hangs at exit") from None
        assert script.returncode == 0 and "Traceback" not in err, err
        deadline = time.monotonic() + 15
        while any(map(pid_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if pid_alive(p)], "workers outlived the script"
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
