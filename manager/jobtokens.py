"""A job's token: what a caller shows the manager to act as that job (docs/security.md, Roles).

The first RegisterJob of a job name fixes its token: the one the caller sent
(gRPC metadata ``x-mlcache-job-token``), else a random one the manager makes
and returns in ``JobInfo.token``. Registering that job again, reporting its
batches or pipelines, releasing its chunks and unregistering it then need the
same token. The manager keeps only its SHA-256 (journaled, so a restarted
manager still knows it).

The ranks of one DDP job are separate processes that register one job, so they
need a token they all know before any registers: ``job_token`` derives it from
a secret the launcher gives every rank, ``MLCACHE_JOB_SECRET``, else from what
torchrun gives every rank of one run (TORCHELASTIC_RUN_ID, which stays the same
when torchrun restarts the ranks, unlike MASTER_ADDR and MASTER_PORT; those where
the run id is "none", a static rendezvous). That default keeps jobs apart from
mistakes and from tenants who do not know the run's id; against a tenant who can read another job's
environment, set MLCACHE_JOB_SECRET to a real secret. A lone process with neither
keeps its token of a named job in a user-private file for its next run
(clients/jobtokenfile.py).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

TOKEN_HEADER = "x-mlcache-job-token"
SECRET_ENV = "MLCACHE_JOB_SECRET"
_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def launcher_secret(env: Mapping[str, str] = os.environ) -> str | None:
    """The secret every rank of this launch shares, or None (a lone process)."""
    if env.get(SECRET_ENV):
        return "env:" + env[SECRET_ENV]
    run, addr, port = (env.get(k, "") for k in _TORCHRUN_ENV)
    if run and run != "none":  # alone: torchrun may restart the ranks on another master address or port
        return "torchrun:" + run
    if addr and port:  # static rendezvous (run id "none"): the master's address is the run's
        return "torchrun:none:" + addr + ":" + port
    return None


def job_token(job: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The token this process presents for ``job`` before the manager gave one, or None."""
    secret = launcher_secret(env)
    if secret is None:
        return None
    return hashlib.sha256(b"mlcache/job-token/v1\0" + secret.encode() + b"\0" + job.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_hex(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# The release that brought tokens journaled re-registrations of jobs from a state before
# tokens with the hash of an empty token (it kept none): that hash means "no token".
NO_TOKEN_HASH = token_hash("")


def journaled_hash(ev_hash: object) -> str:
    """The token hash a job_register event gives a job ("": none)."""
    h = str(ev_hash or "")
    return "" if h == NO_TOKEN_HASH else h


def matches(token: str | None, expected_hash: str) -> bool:
    """Whether ``token`` is the one whose hash the manager keeps (a job without one, from
    a state written before tokens, takes any caller)."""
    if not expected_hash:
        return True
    return token is not None and hmac.compare_digest(token_hash(token), expected_hash)


def metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if token is None else ((TOKEN_HEADER, token),)


def presented(context: object) -> str | None:
    """The job token a gRPC caller sent, or None."""
    try:
        md = context.invocation_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # a context without metadata (in-process calls)
        return None
    return dict(md).get(TOKEN_HEADER)
