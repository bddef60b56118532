"""The tests' Ray heads' work-around for ray-project/ray#63202 (tests/raysite/ray_proxy_spawn.py):
in a process that is a head's client proxy, what Ray starts gets no preexec_fn (so CPython vforks
and execs at once); in any other process Ray is left as it is. Checked in real processes: one
whose command line says --mode=proxy, as the proxy's does, and one whose does not."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

RAYSITE = os.path.join(os.path.dirname(__file__), "raysite")

# Starts a process as Ray's start_ray_process does (services.ConsolePopen with a preexec_fn) and
# prints whether the preexec_fn ran in the child (it creates the file named by argv[1]).
CHILD = r'''
import inspect, os, sys
from ray._private import services
assert "ConsolePopen(" in inspect.getsource(services.start_ray_process), "Ray starts processes otherwise now"
marker = sys.argv[1]
p = services.ConsolePopen([sys.executable, "-c", "pass"], preexec_fn=lambda: open(marker, "w").close())
p.wait(60)
print("preexec ran" if os.path.exists(marker) else "no preexec", type(p).__name__)
'''


def run(tmp_path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([RAYSITE, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ran"), *args], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_heads_client_proxy_starts_processes_without_a_preexec_fn(tmp_path):
    assert run(tmp_path, "--mode=proxy") == "no preexec NoPreexecPopen"


def test_other_processes_start_them_as_ray_does(tmp_path):
    assert run(tmp_path, "--mode=specific-server") == "preexec ran ConsolePopen"
