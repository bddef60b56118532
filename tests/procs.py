"""Start and stop real daemon processes on loopback for integration tests."""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STACK_DUMPERS = ("cacheserver.serverd", "manager.managerd")  # faulthandler on SIGUSR1


@dataclass
class Daemon:
    args: list[str]
    log_path: str
    proc: subprocess.Popen | None = None
    address: str = ""
    extra_env: dict = field(default_factory=dict)

    def start(self, timeout: float = 20.0) -> "Daemon":
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *self.args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=self._log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if line.startswith("READY "):
                self.address = line.split()[1]
                return self
            if self.proc.poll() is not None:
                break
        self.kill()
        with open(self.log_path, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        raise RuntimeError(f"{self.args[0]} did not become ready; log tail:\n{tail}")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:  # where it hangs: our daemons dump stacks at SIGUSR1
            if self.args[0] in STACK_DUMPERS:
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
            with open(self.log_path, "rb") as f:
                e.add_note(f"{self.args[0]} log tail:\n" + f.read()[-6000:].decode(errors="replace"))
            raise
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid


def cacheserver(data_dir: str, capacity: str = "1GB", port: int = 0, *extra: str) -> Daemon:
    """A cacheserver daemon (not started). Port 0: the OS picks one at bind time (no race)."""
    os.makedirs(data_dir, exist_ok=True)
    listen = f"127.0.0.1:{port}"
    return Daemon(["cacheserver.serverd", "--listen", listen, "--data-dir", data_dir,
                   "--capacity", capacity, "--log-format", "text", *extra],
                  log_path=os.path.join(data_dir, "server.log"))


def settle(cpu: Callable[[], float], idle_cores: float = 0.05, window: float = 0.5, limit: float = 60.0
           ) -> float:
    """Wait (at most `limit` s) until `cpu` (CPU seconds of the processes a benchmark measures)
    grows by under `idle_cores` over a `window`: RocksDB's flush and compactions after a filling
    epoch are the fill's cost, not the hits' (on 2 cores they ran through the next 3 epochs of
    tools/bench/epoch at twice the hits' CPU). Returns the CPU seconds spent meanwhile."""
    start = cpu()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        c = cpu()
        time.sleep(window)
        if cpu() - c < idle_cores * window:
            break
    return cpu() - start


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cachemanager(state_dir: str, port: int = 0, *extra: str) -> Daemon:
    """A cachemanager daemon (not started), with test-speed intervals unless
    `extra` overrides them (argparse keeps the last occurrence of a flag). Port 0: the OS
    picks one at bind time (a port picked beforehand was once taken meanwhile, in CI)."""
    os.makedirs(state_dir, exist_ok=True)
    listen = f"127.0.0.1:{port}"
    return Daemon(["manager.managerd", "--listen", listen, "--state-dir", state_dir,
                   "--heartbeat-seconds", "0.2", "--decision-seconds", "0.2", "--reconcile-seconds", "0.2", "--log-format", "text", *extra],
                  log_path=os.path.join(state_dir, "manager.log"))


def manager_once(state_dir: str, *extra: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run cachemanager to see whether it starts: one that becomes ready is killed at its READY
    line; the result holds its exit status and output (stdout from the READY line on)."""
    argv = [sys.executable, "-m", "manager.managerd", "--listen", "127.0.0.1:0", "--state-dir", state_dir,
            "--log-format", "text", *extra]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()  # READY host:port, or "" once it exited
        if first.startswith("READY"):
            p.kill()
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return subprocess.CompletedProcess(argv, p.returncode, first + out, err)


def procs_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def is_zombie(pid: int) -> bool:
    """Whether `pid` is gone or a zombie (exited, not reaped): not a process left running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def make_certs(out: Any) -> Any:
    """A CA, server and client certificates under `out` (`cachectl certs`); `out` back."""
    r = subprocess.run([sys.executable, "-m", "manager.ctl", "certs", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


def stalled_put(connect: Callable[[], socket.socket], held: Callable[[], object], tries: int = 10,
                wait: float = 2.0) -> socket.socket:
    """A data-plane connection holding a server's whole --max-inflight-bytes (smaller than
    60 MiB): a put whose 60 MiB body never comes, sent on `connect()` until `held()` says the
    server answers busy. A body past the budget is admitted only while nothing else is in
    flight, and a request answered just before holds its bytes until the server's thread
    releases them after its answer: then the stall is refused itself, and sent again."""
    from cacheserver import ops, wire

    for _ in range(tries):
        k = connect()
        k.sendall(wire.pack_header(ops.PUT.code, 0, 1, 60 << 20) + bytes(1000))
        try:
            wait_until(held, "the stalled body admitted", wait)
            return k
        except AssertionError:
            k.close()
    raise AssertionError(f"no stalled 60 MiB put body admitted in {tries} tries")


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped: kill() returns before
    a thread on another (or a descheduled) CPU has stopped, and on a loaded host one could still
    answer a request sent right after."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")]
        except (FileNotFoundError, ProcessLookupError):
            return False  # a thread came or went as the list was read: look again
        return all(st in "Tt" for st in states)
    wait_until(stopped, f"process {pid} stopped", timeout)


def wait_until(cond: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    """cond()'s first truthy value, polled every 50 ms; AssertionError naming `what` after `timeout` s.
    The default bounds things that do happen, if late on a loaded machine (CI: 2 test workers on 2
    cores); a test that asserts how soon one happens passes its own timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_ring(address: str, n: int, timeout: float = 30.0) -> None:
    """Wait until the manager at `address` lists `n` cache servers in its ring (they register
    after they start); fails the test if it does not within `timeout` seconds."""
    from manager.manager_client import ManagerClient

    deadline = time.monotonic() + timeout
    with ManagerClient(address, timeout=2) as mc:
        while len(mc.get_ring().addresses) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        got = len(mc.get_ring().addresses)
    assert got == n, f"manager {address} lists {got} cache servers after {timeout} s, not {n}"


def batches_counted(address: str, job: str) -> int | None:
    """Batches the manager at `address` counts for `job` (its status); None: no such job."""
    from manager.manager_client import ManagerClient

    with ManagerClient(address, timeout=2) as mc:
        for j in mc.status_dict(wait=True)["jobs"]:
            if j["job"] == job:
                return int(j.get("batches", 0))
    return None


@contextlib.contextmanager
def manager_with_server(root: str, *manager_args: str) -> Iterator[tuple[Daemon, Daemon]]:
    """A cachemanager and one cacheserver in its ring (registered: the manager's ring lists it),
    stopped on the way out."""
    m = cachemanager(os.path.join(root, "mgr"), 0, *manager_args).start()
    try:
        srv = cacheserver(os.path.join(root, "srv"), "256MB", 0, "--manager", m.address).start()
        try:
            wait_ring(m.address, 1)
            yield m, srv
        finally:
            srv.stop()
    finally:
        m.stop()


@contextlib.contextmanager
def endpoint_process(argv: list[str], port: int, log_path: str, timeout: float = 30.0) -> Iterator[str]:
    """Run a third-party storage endpoint (GCS emulator, moto's S3 server) on a
    loopback port; yields its base URL once it accepts connections. Its output
    goes to a file: an unread pipe fills up and stalls it."""
    exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or argv[0]
    log = open(log_path, "w+b")
    proc = subprocess.Popen([exe, *argv[1:]], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    err = log.read().decode(errors="replace")[-2000:] or "no output"
                    raise RuntimeError(f"{argv[0]} did not start: {err}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def without_features(client, *names: str):
    """Make `client` (a ServerClient) see its server as one from before the named
    features (ops.FEATURES): its Info announces all others only."""
    info = client.info

    def older():
        r = info()
        kept = [f for f in r.features if f not in names]
        del r.features[:]
        r.features.extend(kept)
        return r

    client.info = older
    return client


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def two_ranks(code: str, timeout: float = 240) -> list[tuple[str, str]]:
    """(stdout, stderr) of `code` run as rank 0 and rank 1 (argv[1]) in two real processes
    from the repository's root; both must exit 0."""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return outs


def tf_config_code(workers: int) -> str:
    """Python that sets TF_CONFIG for a MultiWorkerMirroredStrategy of `workers` processes
    on loopback, this one's index from argv[1] (as `r`); for two_ranks' code."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(workers)]
    return ("import json, os, sys; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; r = int(sys.argv[1]); "
            f"os.environ['TF_CONFIG'] = json.dumps({{'cluster': {{'worker': {addresses!r}}}, "
            "'task': {'type': 'worker', 'index': r}}); ")


def load_script(path: str, name: str) -> Any:
    """A script without a .py suffix (tools/demo, tools/bench/*) imported as module `name`."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 150.0) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes (as torchrun's ranks); asserts each
    exited 0, and kills one that hangs (a rank waiting in a collective) rather than leave it."""
    import torch.multiprocessing
    ctx = torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        for p in ctx.processes:
            p.join(timeout)
        assert [p.exitcode for p in ctx.processes] == [0] * nprocs
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)


def raised(fn: Callable[..., Any], *args: Any) -> str:
    """The name of the exception fn(*args) raised ("" if none): for calls made in threads."""
    try:
        fn(*args)
    except Exception as e:
        return type(e).__name__
    return ""
