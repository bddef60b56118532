"""Who may do what on a cache server (docs/security.md, the role matrix).

Without TLS the manager proves its role with a shared cluster token, read
from a file given to the servers and the manager (--cluster-token-file) and
sent as gRPC metadata. Control operations that change another job's
service (modes, chunk references, active chunks, evictions) need it; plain
clients look up, get, put and replace. Stats for a caller without it carry
no job or dataset names. A server started without a token file keeps the
open behaviour of earlier versions (every caller is the manager) and says
so in its log."""
from __future__ import annotations

import hmac
import os
from typing import Any

import grpc

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
    if os.stat(path).st_mode & 0o077:
        raise ValueError(f"--cluster-token-file {path}: readable by others; chmod 600 it")
    return token


def metadata(token: bytes | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata that carries ``token`` (None: send nothing)."""
    return None if token is None else ((TOKEN_HEADER, token.decode()),)


class Roles:
    def __init__(self, token: bytes | None) -> None:
        self.token = token

    def is_manager(self, context: Any) -> bool:
        if self.token is None:
            return True
        given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self.token)

    def require_manager(self, context: Any, op: str) -> None:
        if not self.is_manager(context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{op} is an operation of the cache manager: it needs the cluster token "
                          "(--cluster-token-file); plain clients may look up, get, put and replace")


def strip_tenants(resp: Any) -> Any:
    """A StatsResponse without other tenants' job and dataset names."""
    resp.ClearField("chunks")
    resp.ClearField("active_chunks")
    resp.ClearField("job_modes")
    return resp
