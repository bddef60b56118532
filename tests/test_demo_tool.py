"""tools/demo's start barrier against real job processes: a job that never says READY
fails its row within the deadline instead of hanging the demo on its pipe; and SIGTERM
mid-run stops its daemons and removes its directory."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import is_zombie, load_script, procs_naming

pytestmark = pytest.mark.timeout(60)
DEMO = Path(__file__).resolve().parents[1] / "tools" / "demo"


def load_demo():
    return load_script(DEMO, "mlcache_demo_tool")


def job(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_the_start_barrier_is_bounded_and_reads_ready_exits_and_silence():
    demo = load_demo()
    ready = job("import sys, time; print('READY', flush=True); time.sleep(30)")
    dead = job("import sys; sys.exit(3)")
    stuck = job("import time; time.sleep(30)")  # start-up that never ends
    try:
        assert demo.said_ready(ready, time.monotonic() + 20)
        assert not demo.said_ready(dead, time.monotonic() + 20) and dead.returncode == 3
        t0 = time.monotonic()
        assert not demo.said_ready(stuck, t0 + 0.5)
        assert time.monotonic() - t0 < 5 and stuck.poll() is None
    finally:
        for p in (ready, dead, stuck):
            p.kill()
            p.wait(10)


@contextlib.contextmanager
def demo_in_its_lru_row(tmp_path, **popen) -> Iterator[subprocess.Popen]:
    """The demo (30 items, 1 job, no baselines) once its LRU row's job has started; afterwards
    it is killed if still running, and so is anything it left naming tmp_path."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    demo = subprocess.Popen([sys.executable, str(DEMO), "--items", "30", "--jobs", "1", "--no-baselines"],
                            env=env, stdout=subprocess.DEVNULL, **popen)
    try:
        deadline = time.monotonic() + 150
        while not list(tmp_path.glob("mlcache-demo-*/lru0-job0.log")) and time.monotonic() < deadline:
            assert demo.poll() is None, "the demo ended before its LRU row"
            time.sleep(0.1)
        yield demo
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
        for pid in procs_naming(str(tmp_path)):  # what a failed run left
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_sigterm_mid_run_stops_the_daemons_and_removes_the_temp_dir(tmp_path):
    # SIGTERM (`timeout make demo`, a CI runner) once the LRU row's servers and job run.
    with demo_in_its_lru_row(tmp_path, stderr=subprocess.DEVNULL) as demo:
        daemons = procs_naming(str(tmp_path))
        assert len(daemons) >= 3, "the LRU row's servers and job did not start"
        demo.send_signal(signal.SIGTERM)
        rc = demo.wait(60)
        time.sleep(0.5)  # a daemon the demo left would still run now
        left = [pid for pid in daemons if os.path.exists(f"/proc/{pid}") and not is_zombie(pid)]
        assert left == [] and list(tmp_path.iterdir()) == []
        assert rc == 128 + signal.SIGTERM


@pytest.mark.timeout(240)
def test_demo_ctrl_c_mid_row_is_not_blamed_on_the_daemons(tmp_path):
    # Ctrl-C reaches the demo's whole process group; the daemons, draining after SIGINT,
    # were ended by the demo's SIGTERM, and the demo replaced the interrupt with
    # "demo: a daemon did not stop cleanly" (exit 1).
    with demo_in_its_lru_row(tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as demo:
        time.sleep(1.0)  # the row's job under way
        assert demo.poll() is None, "the demo ended before the interrupt"
        os.killpg(demo.pid, signal.SIGINT)
        _, err = demo.communicate(timeout=60)
        assert "did not stop cleanly" not in err, err[-2000:]
        assert "KeyboardInterrupt" in err and demo.returncode == -signal.SIGINT, err[-2000:]
        time.sleep(0.5)
        assert procs_naming(str(tmp_path)) == [] and list(tmp_path.iterdir()) == []


def test_demo_row_keeps_its_own_error_over_a_daemons_exit(tmp_path):
    # A daemon that does not exit 0 (http.server dies of the SIGTERM) fails a row that
    # ran, but must not replace the error a failing row is already raising.
    demo = load_demo()
    daemons = demo.Daemons(str(tmp_path))
    rows = demo.CachedRows(str(tmp_path), daemons, None, None, None, 1, 1)
    for failing in (True, False):
        daemons.spawn("d0", "http.server", "0", "--bind", "127.0.0.1")
        with pytest.raises(KeyboardInterrupt if failing else SystemExit) as e:
            with rows._stopping(["d0"], []):
                if failing:
                    raise KeyboardInterrupt
        assert daemons.procs == {}
        assert failing or "d0 (exit -15" in str(e.value)




@pytest.mark.parametrize("flag,value,why", [("--bandwidth", "fast", "not a size"),
                                            ("--latency", "soon", "not a duration")])
def test_a_bad_store_flag_is_refused_before_any_work(tmp_path, flag, value, why):
    r = subprocess.run([sys.executable, str(DEMO), flag, value], env=dict(os.environ, TMPDIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
