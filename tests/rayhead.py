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
    def __init__(self, cpus: int = 2) -> None:
        self.tmp = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths have a length limit
        self.port, self.client_port = ray_free_ports(2)
        env = dict(os.environ, **HEAD_ENV, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        self.log = open(os.path.join(self.tmp, "head.log"), "wb")
        self.proc = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.port}",
             f"--ray-client-server-port={self.client_port}", f"--num-cpus={cpus}", "--include-dashboard=false",
             "--object-store-memory=100000000", "--disable-usage-stats", f"--temp-dir={self.tmp}"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    def connect(self, timeout: float = 150.0):
        """Join as a Ray Client (this process); returns the ray module. The bound is for a
        loaded machine: the head and the client's server each start Python processes."""
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
                ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
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


@contextlib.contextmanager
def unjoined_head(cpus: int = 2):
    """A head nobody is connected to (a module fixture's): start() makes (and leaves) the
    connection. Waits for the head to come up; at the end no share of a connection outlives it."""
    import ray

    from preprocess.remote import cluster

    for k, v in HEAD_ENV.items():
        os.environ.setdefault(k, v)
    h = RayHead(cpus=cpus)
    try:
        h.connect()
        disconnect(ray)
        yield h
    finally:
        disconnect(ray)
        cluster._Joined.users = 0  # a failed test's shares must not outlive the module
        h.close()
