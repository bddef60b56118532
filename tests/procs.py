"""Start and stop real daemon processes on loopback for integration tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return Daemon(["cacheserver.daemon", "--listen", listen, "--data-dir", data_dir,
                   "--capacity", capacity, "--log-format", "text", *extra],
                  log_path=os.path.join(data_dir, "server.log"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cachemanager(state_dir: str, port: int = 0, *extra: str) -> Daemon:
    """A cachemanager daemon (not started), with test-speed intervals unless
    `extra` overrides them (argparse keeps the last occurrence of a flag)."""
    os.makedirs(state_dir, exist_ok=True)
    listen = f"127.0.0.1:{port or free_port()}"
    return Daemon(["manager.daemon", "--listen", listen, "--state-dir", state_dir,
                   "--heartbeat-seconds", "0.2", "--decision-seconds", "0.2", "--log-format", "text", *extra],
                  log_path=os.path.join(state_dir, "manager.log"))
