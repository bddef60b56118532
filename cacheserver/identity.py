"""Who is on the other end of a request, for the replaces each identity makes.

A replace overwrites an entry a client found poisoned (the repair path); any
plain client may do it, so an operator should see who does it how often
(`mlcache_server_replaces_total{peer=...}`). The identity is the client
certificate's common name under mutual TLS, else the peer's address (the
host, not the port), or the uid on the Unix socket. The serving thread sets
it (a data-plane connection's thread, a gRPC call's thread); core.put reads
it."""
from __future__ import annotations

import collections
import socket
import ssl
import struct
import threading
from typing import Any

_local = threading.local()
_UCRED = struct.Struct("3i")


def set_peer(identity: str) -> None:
    _local.peer = identity


def current_peer() -> str:
    return getattr(_local, "peer", "unknown")


def _cert_cn(cert: dict | None) -> str | None:
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


def dataplane_identity(conn: socket.socket) -> str:
    if conn.family == socket.AF_UNIX:
        try:
            _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            return f"unix:uid={uid}"
        except OSError:
            return "unix"
    if isinstance(conn, ssl.SSLSocket):
        cn = _cert_cn(conn.getpeercert())
        if cn:
            return f"cert:{cn}"
    try:
        return f"tcp:{conn.getpeername()[0]}"
    except OSError:
        return "tcp"


def grpc_identity(context: Any) -> str:
    try:
        cn = context.auth_context().get("x509_common_name")
        if cn:
            return f"cert:{cn[0].decode()}"
        peer = context.peer()  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555"
    except Exception:  # a context without them (tests, in-process calls)
        return "unknown"
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else rest
    return f"tcp:{host}"


class PeerCounts:
    """Replaces per identity (a bounded number of identities: the oldest beyond it are merged)."""
    MAX = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, identity: str, n: int) -> None:
        with self._lock:
            if identity not in self._counts and len(self._counts) >= self.MAX:
                identity = "other"
            self._counts[identity] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
