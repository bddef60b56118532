"""`cachectl local-cluster`: N cacheserver processes on 127.0.0.1 in the foreground, for development."""
from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from cacheserver.sigflag import SignalFlag

from .ctlcommon import PROG, CtlError, HelpFormatter, seconds


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # As the servers bind: SO_REUSEADDR, so TIME_WAIT leftovers don't count as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_pairs(n: int) -> list[int]:
    """n ports p with p and p + 1 (the data plane) both free."""
    out: list[int] = []
    for _ in range(200 * n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535 and p not in out and p + 1 not in out and p - 1 not in out and _port_free(p + 1):
            out.append(p)
            if len(out) == n:
                return out
    raise CtlError(f"local-cluster: could not find {n} free port pairs on 127.0.0.1")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


class _Server:
    def __init__(self, index: int, addr: str, data_dir: str, argv: list[str]) -> None:
        self.index, self.addr, self.data_dir = index, addr, data_dir
        self.log_path = os.path.join(data_dir, "server.log")
        os.makedirs(data_dir, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # The servers import this same cacheserver package, wherever cachectl was started from.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Own session: a Ctrl-C on the terminal reaches cachectl only, which then
        # stops the servers in order; PDEATHSIG stops them if cachectl is killed.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._buf = b""
        self.ready = False

    def poll_ready(self) -> bool | None:
        """True once READY was printed, None if the process exited, else False."""
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            self._buf += chunk
            for line in self._buf.split(b"\n")[:-1]:
                if line.startswith(b"READY "):
                    self.addr = line.split()[1].decode()
                    self.ready = True
                    return True
        if self.proc.poll() is not None:
            return None
        return False

    def close(self) -> None:
        self.proc.stdout.close()
        self._log.close()


def cmd_local_cluster(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cacheserver.sizes import parse_size
    n = args.servers
    if n < 1:
        parser.error("--servers must be >= 1")
    try:
        capacity = parse_size(args.capacity)
    except ValueError as e:
        parser.error(f"--capacity: {e}")
    addrs = [f"127.0.0.1:{p}" for p in _cluster_ports(args.base_port, n, parser)]
    stop = SignalFlag((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))  # not an Event: see its module
    temp = args.data_dir is None
    base = tempfile.mkdtemp(prefix="mlcache-local-") if temp else os.path.abspath(args.data_dir)
    servers: list[_Server] = []
    rc = 0
    try:
        _start_servers(args, base, addrs, capacity, servers)
        _wait_ready(servers, stop, args.start_timeout)
        if not stop.is_set():
            _announce(args, servers, base, temp, capacity)
        rc = _watch(servers, stop)
    except CtlError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        rc = 1
    except OSError as e:  # a data dir that cannot be made (a file in the way), a failed spawn
        where = f" {e.filename}" if e.filename else ""
        print(f"{PROG}: local-cluster:{where}: {e.strerror or e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        rc = _stop_servers(servers, args.stop_timeout, rc)
        stop.restore()
        if temp:
            shutil.rmtree(base, ignore_errors=True)
    if rc == 0 and stop.received:
        print(f"stopped {n} server{'s' if n > 1 else ''}", flush=True)
    return rc


def _cluster_ports(base_port: int | None, n: int, parser: argparse.ArgumentParser) -> list[int]:
    """The gRPC port of each server (its data plane is the next one up)."""
    if base_port is None:
        return _free_pairs(n)
    if not 1 <= base_port <= 65535 - 2 * n:
        parser.error(f"--base-port {base_port}: no room for {n} port pairs")
    ports = [base_port + 2 * i for i in range(n)]
    busy = [p for q in ports for p in (q, q + 1) if not _port_free(p)]
    if busy:
        raise CtlError(f"local-cluster: port{'s' if len(busy) > 1 else ''} "
                       f"{', '.join(map(str, busy))} on 127.0.0.1 already in use "
                       f"(server i uses BASE+2i for gRPC and BASE+2i+1 for its data plane)")
    return ports


def _start_servers(args: argparse.Namespace, base: str, addrs: list[str], capacity: int,
                   servers: list[_Server]) -> None:
    """Appends each server to `servers` as it starts: after a failure the caller stops those."""
    os.makedirs(base, exist_ok=True)
    for i, addr in enumerate(addrs):
        argv = [sys.executable, "-m", "cacheserver.serverd", "--listen", addr,
                "--data-dir", os.path.join(base, f"server-{i}"), "--capacity", str(capacity),
                "--peers", ",".join(addrs), "--log-format", args.log_format, "--log-level", args.log_level,
                "--eviction", args.eviction]
        if args.metrics_base_port is not None:
            argv += ["--metrics-port", str(args.metrics_base_port + i)]
        servers.append(_Server(i, addr, os.path.join(base, f"server-{i}"), argv))


def _wait_ready(servers: list[_Server], stop: SignalFlag, timeout: float) -> None:
    """Until every server printed READY (or a signal came); CtlError if one exits or is late."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(servers)))
    while pending and not stop.is_set():
        for i in sorted(pending):
            state = servers[i].poll_ready()
            if state is True:
                pending.discard(i)
            elif state is None:
                s = servers[i]
                raise CtlError(f"local-cluster: server {i} ({s.addr}) exited with code "
                               f"{s.proc.returncode} while starting; log {s.log_path}:\n{_tail(s.log_path)}")
        if pending and time.monotonic() > deadline:
            late = ", ".join(f"{i} ({servers[i].addr})" for i in sorted(pending))
            raise CtlError(f"local-cluster: server {late} not ready after {timeout:.0f}s; "
                           f"log {servers[min(pending)].log_path}:\n{_tail(servers[min(pending)].log_path)}")
        if pending:
            stop.wait(0.05)


def _announce(args: argparse.Namespace, servers: list[_Server], base: str, temp: bool, capacity: int) -> None:
    n = len(servers)
    where = f"{base} (removed at exit)" if temp else base
    print(f"local cluster: {n} server{'s' if n > 1 else ''} x {args.capacity} "
          f"({capacity:,} bytes), data in {where}")
    for s in servers:
        port = s.addr.rsplit(":", 1)[1]
        extra = f", metrics :{args.metrics_base_port + s.index}" if args.metrics_base_port is not None else ""
        print(f"  server {s.index}  {s.addr}  (data plane :{int(port) + 1}{extra}, pid {s.proc.pid}, "
              f"log {s.log_path})")
    print(f"ready: {','.join(s.addr for s in servers)}")
    print(f"use: cache={','.join(s.addr for s in servers)}   "
          f"(inspect: {PROG} ring {servers[0].addr}; Ctrl-C stops the cluster)", flush=True)


def _watch(servers: list[_Server], stop: SignalFlag) -> int:
    """Until a signal (0) or a server dies (1, after saying which)."""
    while not stop.is_set():
        dead = [s for s in servers if s.proc.poll() is not None]
        if dead:
            for s in dead:
                print(f"{PROG}: server {s.index} ({s.addr}) died with exit code {s.proc.returncode}; "
                      f"log {s.log_path}:\n{_tail(s.log_path)}", file=sys.stderr, flush=True)
            print(f"{PROG}: stopping the other servers", file=sys.stderr, flush=True)
            return 1
        stop.wait(0.25)
    return 0


def _stop_servers(servers: list[_Server], timeout: float, rc: int) -> int:
    """SIGTERM every live server, wait for the drain, kill what is left."""
    live = [s for s in servers if s.proc.poll() is None]
    for s in live:
        try:
            s.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for s in live:
        try:
            code = s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{PROG}: server {s.index} ({s.addr}) did not stop within {timeout:.0f}s; killing it",
                  file=sys.stderr, flush=True)
            s.proc.kill()
            s.proc.wait()
            rc = 1
            continue
        # Stopped before READY, a server may not have its SIGTERM handler yet (Ctrl-C during the start).
        if code != 0 and not (code == -signal.SIGTERM and not s.ready):
            print(f"{PROG}: server {s.index} ({s.addr}) exited with code {code} on stop; "
                  f"log {s.log_path}:\n{_tail(s.log_path)}", file=sys.stderr, flush=True)
            rc = 1
    for s in servers:
        s.close()
    return rc


def add_local_cluster_parser(sub: Any) -> None:
    lc = sub.add_parser("local-cluster", formatter_class=HelpFormatter,
                        help="run N cacheservers on 127.0.0.1 in the foreground (development)",
                        description="Start N cacheserver processes on 127.0.0.1, each with --peers listing "
                                    "all; stop them all on Ctrl-C or SIGTERM. Server i listens on "
                                    "BASE+2i (gRPC) and BASE+2i+1 (data plane).")
    lc.add_argument("--servers", type=int, default=3, help="number of servers")
    lc.add_argument("--capacity", default="1GB", help="capacity of each server")
    lc.add_argument("--base-port", type=int, default=None, help="first gRPC port (default: free ports)")
    lc.add_argument("--data-dir", default=None,
                    help="keep data in DIR/server-I (default: a temporary directory removed at exit)")
    lc.add_argument("--metrics-base-port", type=int, default=None,
                    help="serve Prometheus metrics of server i on this port + i")
    lc.add_argument("--eviction", default="lru", choices=["lru", "none"], help="each server's --eviction")
    lc.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="each server's --log-level")
    lc.add_argument("--log-format", default="text", choices=["json", "text"],
                    help="each server's --log-format")
    lc.add_argument("--start-timeout", type=seconds, default=30.0, help="seconds to wait for all servers")
    lc.add_argument("--stop-timeout", type=seconds, default=20.0, help="seconds to wait for a graceful stop")
    lc.set_defaults(func=cmd_local_cluster, subparser=lc)
