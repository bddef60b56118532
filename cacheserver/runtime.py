"""What both daemons (cacheserver, cachemanager) share: binding the gRPC port
and running in the foreground until SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc

from .sigflag import POLL_S, SignalFlag
from .tls import TlsFiles

log = logging.getLogger("mlcache")


def split_hostport(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{what}: expected HOST:PORT, got {addr!r}")
    if int(port) > 65535:  # gRPC would bind the port modulo 65536, sockets raise OverflowError
        raise ValueError(f"{what}: port out of range in {addr!r}")
    return host.strip("[]"), int(port)


def join_hostport(host: str, port: int) -> str:
    """HOST:PORT as clients dial it: an IPv6 address in brackets ("[::1]:7400")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_grpc(server: grpc.Server, listen: str, tls: TlsFiles | None) -> tuple[str, int]:
    """Bind `listen` (port 0: any free port); returns (host, bound port)."""
    host, port = split_hostport(listen, "--listen")
    bind = join_hostport(host, port)
    try:
        if tls:
            bound = server.add_secure_port(bind, tls.grpc_server_credentials())
        else:
            bound = server.add_insecure_port(bind)
    except RuntimeError:  # newer grpcio raises where older releases returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"--listen: cannot bind {listen} (in use or not a local address)")
    return host, bound


def run_until_signal(start: Callable[[], None], stop: Callable[[], None], address: Callable[[], str],
                     *, poll_s: float = POLL_S) -> int:
    """Start, print `READY host:port` (scripts and tests read it), wait for
    SIGTERM or SIGINT (seen within `poll_s`), then stop (drain). Returns the exit code, 0."""
    stopping = SignalFlag((signal.SIGTERM, signal.SIGINT))  # not an Event: see sigflag.py
    start()
    print(f"READY {address()}", flush=True)
    while not stopping.wait(60.0, poll_s):
        pass
    log.info("signal received, draining")
    stop()  # a second signal meanwhile only sets `stopping` again
    # Drained and flushed: a late signal has nothing left to stop. Ignored, not left to the
    # interpreter, which restores the default action of handled signals as it exits: Ctrl-C
    # (SIGINT to the whole process group) then `make demo`'s or a supervisor's SIGTERM
    # killed the exiting daemon (exit -15, read as an unclean stop).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return 0


def release_grpc(server: grpc.Server, pool: Any) -> None:
    """Free the ports of a gRPC server that bound them but never served (a start-up that
    failed later, in a process that goes on): grpcio frees them only when a started server
    stops. Then its executor's threads, which grpc leaves running."""
    try:
        server.start()
    except Exception:  # nothing bound: nothing to free
        pass
    server.stop(None).wait(5)
    pool.shutdown(wait=False)
