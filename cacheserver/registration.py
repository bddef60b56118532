"""A cache server's link to the cache manager (--manager): register, then
heartbeat every interval the manager asks for.

The manager being down never affects serving: failures are logged (once per
outage, not per attempt) and retried at the heartbeat interval. A manager that
answers "not registered" (fresh state directory, or this server was removed)
gets a new registration; a manager restarted from its journal still knows
the server, and the next heartbeat simply continues.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

import grpc

from .proto import manager_pb2 as mpb
from .proto import manager_pb2_grpc as mpb_grpc
from .roles import metadata
from .runtime import join_hostport, split_hostport
from .tls import FAST_RECONNECT, TlsFiles, grpc_channel

log = logging.getLogger("cacheserver.registration")


def advertised(address: str, manager: str = "") -> str:
    """The address others dial. A wildcard listen address is replaced by the host's name
    where that resolves to an address other hosts can reach; else (a name that resolves
    to loopback only, as where /etc/hosts maps it to 127.0.0.1: every server would join
    the ring as the same "localhost") by this host's address on its route to the manager."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return address
    name = socket.getfqdn()
    if _beyond_loopback(name):
        return join_hostport(name, int(port))
    ip = _route_address(manager)
    if ip is None:
        log.warning("listening on %s: the host name %r resolves to loopback only; registering as it anyway "
                    "(set --listen to the address clients dial)", address, name)
        return join_hostport(name, int(port))
    log.warning("listening on %s: the host name %r resolves to loopback only, so this server registers as "
                "%s, its address on the route to the manager (set --listen to the address clients dial)",
                address, name, ip)
    return join_hostport(ip, int(port))


def _beyond_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return any(not ipaddress.ip_address(a[4][0].split("%")[0]).is_loopback for a in infos)


def _route_address(manager: str) -> str | None:
    """This host's source address toward the manager (a UDP connect sends nothing)."""
    try:
        host, port = split_hostport(manager, "--manager")
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except (OSError, ValueError):
        return None


class ManagerLink:
    def __init__(self, manager: str, address: str, server_id: str, stats: Callable[[], tuple[int, int, int]], *,
                 tls: TlsFiles | None = None, interval: float = 5.0, timeout: float = 2.0,
                 on_ring: Callable[[list[str]], None] | None = None, token: bytes | None = None) -> None:
        """``stats()`` -> (capacity, used, items); ``token``: the cluster token, which the
        manager asks of a server joining its ring (without TLS)."""
        self.manager = manager
        self.address = advertised(address, manager)
        self.server_id = server_id
        self.stats = stats
        self.interval = interval
        self.timeout = timeout
        self.on_ring = on_ring
        self.registered = False
        self.ring_version = -1
        self.failures = 0
        self.channel = grpc_channel(manager, tls, FAST_RECONNECT)
        self.stub = mpb_grpc.ManagerStub(self.channel)
        self._md = metadata(token)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="manager-link", daemon=True)

    def _ring(self, version: int, addresses) -> None:
        if version != self.ring_version:
            self.ring_version = version
            log.info("ring version %d: %s", version, ", ".join(addresses))
            if self.on_ring is not None:
                self.on_ring(list(addresses))

    def beat_once(self) -> None:
        capacity, used, items = self.stats()
        if not self.registered:
            r = self.stub.RegisterServer(mpb.RegisterServerRequest(
                address=self.address, server_id=self.server_id, capacity=capacity, used=used, items=items),
                timeout=self.timeout, metadata=self._md)
            self.registered = True
            if r.heartbeat_seconds > 0:
                self.interval = r.heartbeat_seconds
            log.info("registered with manager %s as %s", self.manager, self.address)
            self._ring(r.ring_version, r.addresses)
            return
        r = self.stub.Heartbeat(mpb.HeartbeatRequest(server_id=self.server_id, address=self.address, used=used,
                                                     items=items, capacity=capacity), timeout=self.timeout,
                                   metadata=self._md)
        if not r.registered:
            log.info("manager %s does not know this server: registering again", self.manager)
            self.registered = False
            self.beat_once()
            return
        if r.heartbeat_seconds > 0:
            self.interval = r.heartbeat_seconds
        self._ring(r.ring_version, r.addresses)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat_once()
                if self.failures:
                    log.info("manager %s reachable again after %d failed attempts", self.manager, self.failures)
                self.failures = 0
            except grpc.RpcError as e:
                if self.failures == 0:
                    self._log_failure(e)
                self.failures += 1
            except Exception:  # never let the link take the server down
                log.exception("manager link error")
                self.failures += 1
            self._stop.wait(self.interval)

    def _log_failure(self, e: grpc.RpcError) -> None:
        """Once per outage: unreachable, or refused (the manager says why: a live server of
        another id at this address, say), which the operator must read to fix."""
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            log.warning("manager %s unreachable, serving on and retrying every %.1fs: %s",
                        self.manager, self.interval, code)
        else:
            log.warning("manager %s refused this server (%s: %s); serving on outside its ring and retrying "
                        "every %.1fs", self.manager, code, e.details(), self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout + 1)
        self.channel.close()
