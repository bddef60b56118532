"""A real Ray head on loopback for the remote-worker tests: `ray start --head --block`
in its own process group (so a test can kill the whole cluster with one signal),
its files under a temp dir of its own, the client server on a free port."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from procs import ROOT, free_port

# Ray resolves 127.0.0.1 to the host's outward address unless told it is not a cluster;
# token auth off: the tests' client and the head share no token file.
HEAD_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray waits 30 s for its GCS server's port file; on a loaded 2-core CI host (the other
            # pytest worker busy) the GCS took longer: "Timed out waiting for file .../gcs_server_port"
            "RAY_gcs_server_port_wait_time_s": "120"}
# Not RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S (Ray's wait for the client server it starts per
# Ray Client connection, 30 s): "Starting Ray client server failed" is a server that died
# within milliseconds of its fork, empty logs, and Ray's client hears of it only after that
# wait plus ~10 s (at 120 s a test lost 130 s to each such death). Those deaths are
# ray-project/ray#63202, worked around by the head's sitecustomize (raysite/ray_proxy_spawn.py).
RAYSITE = os.path.join(ROOT, "tests", "raysite")

# Ports Ray's components take by default whatever we pass (dashboard, its agent's HTTP server,
# GCS, the client server, the metrics agent): a free port picked at random may be one of them
# ("Ray component dashboard_agent_http is trying to use a port number 52365 that is used by
# other components", seen in CI).
RAY_DEFAULT_PORTS = frozenset({6379, 8076, 8265, 10001, 44217, 44227, 52365})


def ray_free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, none of Ray's defaults (bounded: 100 tries)."""
    out: list[int] = []
    for _ in range(100):
        p = free_port()
        if p not in RAY_DEFAULT_PORTS and p not in out:
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free ports outside Ray's defaults in 100 tries")


class RayHead:
    def __init__(self, cpus: int = 2, env: dict[str, str] | None = None, path: tuple[str, ...] = ()) -> None:
        """`env`: more of the head's environment; `path`: directories before RAYSITE and the
        repository on its PYTHONPATH (a fault test's sitecustomize, which applies RAYSITE's too)."""
        self.tmp = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths have a length limit
        self.port, self.client_port = ray_free_ports(2)
        env = {**os.environ, **HEAD_ENV, **(env or {}),
               "PYTHONPATH": os.pathsep.join([*path, RAYSITE, ROOT, os.path.join(ROOT, "tests")])}
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        self.log = open(os.path.join(self.tmp, "head.log"), "wb")
        self.proc = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.port}",
             f"--ray-client-server-port={self.client_port}", f"--num-cpus={cpus}", "--include-dashboard=false",
             # no log monitor: it only forwards workers' output to drivers, and every test's
             # client joins with log_to_driver=False (worker_logs reads the workers' files)
             "--include-log-monitor=false",
             "--object-store-memory=100000000", "--disable-usage-stats", f"--temp-dir={self.tmp}"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    def connect(self, timeout: float = 150.0, **init):
        """Join as a Ray Client (this process); returns the ray module. The bound is for a
        loaded machine: the head and the client's server each start Python processes.
        `init`: more of ray.init's arguments (a job's runtime_env)."""
        import ray

        os.environ.update(HEAD_ENV)
        deadline = time.monotonic() + timeout
        # not before the head says it is up: a Ray Client connect that fails half-way (its server
        # still starting) stalls ~40 s in its own disconnect (joining its log stream's thread)
        while b"Ray runtime started" not in self._log_bytes() and self.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        while True:
            try:
                ray.init(address=self.address, logging_level="ERROR", log_to_driver=False, **init)
                return ray
            except Exception as e:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"Ray head did not come up ({type(e).__name__}: {e}); "
                                       f"log tail:\n{self.tail()}") from None
                time.sleep(0.5)

    def _log_bytes(self) -> bytes:
        with open(os.path.join(self.tmp, "head.log"), "rb") as f:
            return f.read()

    def tail(self) -> str:
        return self._log_bytes()[-3000:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the head's whole process group: the cluster is gone at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def disconnect(ray) -> None:
    from preprocess.remote.cluster import disconnect as leave

    leave(ray)


def started(ds, pipe, address, tries=3, **kw):
    """preprocess.remote.start() that must give remote workers: under load the head's Ray
    Client server may not come up in time (start() answers None with a warning: the job
    would run local workers), or a Ray call while the workers start may fail (the pool
    breaks: no worker). Tried again a bounded number of times; else the test fails saying
    why (the warnings' text), not with an AttributeError on None or `0 == 2` workers."""
    from preprocess.remote import start

    said = []
    for _ in range(tries):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rw = start(ds, pipe, 0, address, **kw)
        if rw is not None and rw.pool.broken is None:
            return rw
        if rw is not None:
            rw.close()
        said += [str(w.message) for w in caught]
    import pytest

    pytest.fail(f"start() gave no remote workers in {tries} tries: {said}")


def leave(ray) -> None:
    """This process off the cluster, and no share of a connection start() made outliving it
    (a failed test's shares must not reach the next test's connection)."""
    from preprocess.remote import cluster

    disconnect(ray)
    cluster._Joined.users = 0


def held_cpus(ray, wait: float) -> float:
    """CPUs of the cluster that actors or tasks hold, once they are free or `wait` s passed:
    an earlier client's actors end as its session is released (Ray's view of the
    resources follows a moment later)."""
    deadline = time.monotonic() + wait
    while True:
        held = ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)
        if held <= 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


class SharedHead:
    """One Ray head (2 CPUs) for the test modules of a pytest process that neither kill nor
    reconfigure theirs (conftest's ray_heads, shared_head): a head's start-up is 5-8 s on a
    loaded CI host. Started on first use, closed at the session's end. A module starts on
    it idle (`idle`: nothing of an earlier module's left on it, this process not joined)
    and leaves it at its end (`module`); a test gets it live (`live`: started anew if dead)."""

    CPUS = 2
    IDLE_WAIT_S = 10.0  # then a new head: cheaper than waiting out a lost client's reconnect grace (10-30 s)

    def __init__(self) -> None:
        self.head: RayHead | None = None
        self.starts = 0

    def live(self) -> RayHead:
        """The head, up; started anew (and waited for) where there was none or it died."""
        if self.head is None or self.head.proc.poll() is not None:
            self._start()
        return self.head

    def idle(self, wait: float = IDLE_WAIT_S) -> RayHead:
        """The live head with no CPU held (no actor or task of an earlier module left), this
        process not joined to it; one still busy after `wait` s is replaced, with a warning."""
        starts = self.starts
        h = self.live()
        if self.starts != starts:
            return h  # new: nothing on it
        ray = h.connect()
        try:
            held = held_cpus(ray, wait)
        finally:
            leave(ray)
        if held > 0:
            warnings.warn(f"the shared Ray head had {held:g} CPU(s) held {wait:g} s after the last "
                          f"module left it (actors or tasks left running): replaced", RuntimeWarning)
            self._start()
        return self.head

    @contextlib.contextmanager
    def module(self):
        """A module's turn: the head idle at its start; at its end this process leaves it."""
        import ray

        try:
            yield self.idle()
        finally:
            leave(ray)

    def _start(self) -> None:
        self.close()
        self.head = RayHead(cpus=self.CPUS)
        self.starts += 1
        leave(self.head.connect())  # waits for it to come up

    def close(self) -> None:
        import ray

        leave(ray)
        if self.head is not None:
            self.head.close()
            self.head = None
