"""tools/demo's start barrier against real job processes: a job that never says READY
fails its row within the deadline instead of hanging the demo on its pipe."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
DEMO = Path(__file__).resolve().parents[1] / "tools" / "demo"


def load_demo():
    loader = importlib.machinery.SourceFileLoader("mlcache_demo_tool", str(DEMO))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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
