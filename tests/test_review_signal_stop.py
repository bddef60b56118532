"""SIGTERM always stops a daemon. Its handler once set a threading.Event the main thread waited
on: a signal that came while that thread held the event's lock (entering or leaving a wait) hung
the daemon for ever, never draining (a cacheserver in CI, under load). Here the main loop polls
as often as it can (poll_s=0), which makes that window most of its time; and a real server,
asked for its stacks with SIGUSR1, runs on and still stops at SIGTERM."""
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from procs import ROOT, cacheserver, wait_until  # noqa: E402

CHILD = """
from cacheserver.runtime import run_until_signal
stopped = []
rc = run_until_signal(lambda: None, lambda: stopped.append(1), lambda: "nowhere:0", poll_s=0)
print("STOPPED", rc, len(stopped), flush=True)
"""


def test_a_sigterm_at_any_moment_of_the_main_loop_stops_the_daemon():
    rnd = random.Random(7)
    for k in range(12):
        p = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE)
        try:
            assert p.stdout.readline().decode().startswith("READY "), k
            time.sleep(rnd.uniform(0.0, 0.03))
            p.send_signal(signal.SIGTERM)
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"run {k}: no stop 10 s after SIGTERM (the handler hung)") from None
            assert p.returncode == 0 and out.decode().split() == ["STOPPED", "0", "1"], (k, out)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_sigusr1_writes_a_servers_stacks_to_its_log_and_it_runs_on(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "64MB").start()
    try:
        os.kill(s.pid, signal.SIGUSR1)
        dump = wait_until(lambda: (t := open(s.log_path).read()).count("(most recent call first)") >= 2
                          and "in run_until_signal" in t and t, "the threads' stacks in the log", 10)
        assert "dataplane" in dump or "acceptloop" in dump  # the data plane's threads among them
        assert s.proc.poll() is None
        assert s.stop() == 0
    finally:
        s.kill()
