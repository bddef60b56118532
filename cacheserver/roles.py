"""Who may do what on a cache server (docs/security.md, the role matrix).

Under mutual TLS the role comes from the caller's certificate: only one whose
subject names the `manager` role (certs.py, `cachectl certs` writes
manager.pem) is the manager; `server` (peer) and `client` certificates are
plain clients. Without TLS the manager proves its role with a shared cluster token, read
from a file given to the servers and the manager (--cluster-token-file) and
sent as gRPC metadata. Control operations that change another job's
service (modes, chunk references, active chunks, evictions) need it; plain
clients look up, get, put and replace. Stats for a caller without it carry
no job or dataset names. The token also gives the role under TLS. A server
started with neither TLS nor a token file keeps the open behaviour of
earlier versions (every caller is the manager) and says so in its log."""
from __future__ import annotations

import functools
import hmac
import os
from typing import Any

import grpc
from cryptography import x509

from .certs import cert_role

TOKEN_HEADER = "x-mlcache-token"
MIN_TOKEN_BYTES = 16


def read_token(path: str) -> bytes:
    """The token in ``path`` (surrounding whitespace dropped); ValueError says what is wrong."""
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"--cluster-token-file {path}: {e.strerror or e}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"--cluster-token-file {path}: the token has {len(token)} bytes, at least "
                         f"{MIN_TOKEN_BYTES} are needed (e.g. `head -c 32 /dev/urandom | base64 > {path}`)")
    # a group may read it (Kubernetes mounts a Secret's files 0440, root's, in the pod's fsGroup),
    # not write it; others may do neither
    if os.stat(path).st_mode & 0o027:
        raise ValueError(f"--cluster-token-file {path}: readable or writable by others; chmod 600 it (or 640 "
                         f"for a group the server runs in)")
    check_printable(token, f"--cluster-token-file {path}")
    return token


def check_printable(token: bytes, where: str) -> None:
    """gRPC metadata values (keys not ending in -bin) are printable ASCII: a token that is
    not would be read here and fail on every call instead; ValueError names ``where``."""
    bad = next((i for i, b in enumerate(token) if not 0x21 <= b <= 0x7E), None)
    if bad is not None:
        raise ValueError(f"{where}: the token must be printable ASCII without spaces (it is sent as gRPC "
                         f"metadata), byte {bad} is {token[bad]:#04x}; write raw bytes encoded, e.g. "
                         "`head -c 32 /dev/urandom | base64 > FILE`")


def metadata(token: bytes | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata that carries ``token`` (None: send nothing); ValueError for a token
    that cannot travel as metadata."""
    if token is None:
        return None
    check_printable(token, "cluster token")
    return ((TOKEN_HEADER, token.decode()),)


@functools.lru_cache(maxsize=256)
def _pem_role(pem: bytes) -> str | None:
    try:
        return cert_role(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return None


def grpc_cert_role(context: Any) -> str | None:
    """The role named by the caller's TLS certificate (certs.ROLES), or None."""
    try:
        pems = context.auth_context().get("x509_pem_cert")
    except Exception:  # a context without one (in-process calls)
        return None
    return _pem_role(bytes(pems[0])) if pems else None


class Roles:
    def __init__(self, token: bytes | None, tls: bool = False) -> None:
        self.token = token
        self.tls = tls

    def is_manager(self, context: Any) -> bool:
        if self.token is None and not self.tls:
            return True
        if self.tls and grpc_cert_role(context) == "manager":
            return True
        if self.token is None:
            return False
        given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self.token)

    def is_cache_server(self, context: Any) -> bool:
        """A cache server joining the manager's ring: it sends the cluster token (the
        manager's role) or, under mutual TLS, shows a server certificate."""
        return self.is_manager(context) or (self.tls and grpc_cert_role(context) == "server")

    def require_manager(self, context: Any, op: str) -> None:
        if not self.is_manager(context):
            how = "a manager certificate (manager.pem from `cachectl certs`)" if self.tls else ""
            if self.token is not None:
                how = f"{how} or the cluster token (--cluster-token-file)" if how else \
                    "the cluster token (--cluster-token-file)"
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{op} is an operation of the cache manager: it needs {how}; "
                          "plain clients may look up, get, put and replace")


def strip_tenants(resp: Any) -> Any:
    """A StatsResponse without other tenants' job and dataset names."""
    resp.ClearField("chunks")
    resp.ClearField("active_chunks")
    resp.ClearField("job_modes")
    resp.tenants_hidden = True
    return resp
