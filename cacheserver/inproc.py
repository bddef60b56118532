"""Cache servers running inside this process (the embedded default), by address.

A client in the process that runs a server asks the server's core directly
(CacheCore.get, .put and the others: counted, ordered and bypassed exactly as
over the wire) instead of through its own socket and a RocksDB follower: no frames, no copies, no server thread contending for the GIL. Only
the process that registered a server sees it: a forked DataLoader worker
inherits this table, but not the server's threads, so it goes through the
socket as before.

A client that seals values from items it has just checked against its digest
puts them with `vouch`, and vouches for values it has checked after a get: the
core then vouches for those ids until anyone writes them otherwise (trust.py),
and `get_vouched` says which values of a get need no hash check.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from . import ops, wire
from .trust import Since
from .vocab import BadRequest

_lock = threading.Lock()
_cores: dict[str, tuple[int, Any]] = {}  # address -> (pid, CacheCore)


def register(address: str, core: Any) -> None:
    with _lock:
        _cores[address] = (os.getpid(), core)


def unregister(address: str) -> None:
    with _lock:
        _cores.pop(address, None)


def core_for(address: str) -> Any | None:
    """The CacheCore serving `address` in this very process, else None."""
    with _lock:
        found = _cores.get(address)
    if found is None or found[0] != os.getpid():
        return None
    return found[1]


def plain_store(spec: str | None) -> bool:
    """Whether a ring spec names exactly one server, in this process, whose store holds
    plain records (datadir.py): a dataset reading another one's embedded cache."""
    addrs = spec.split(",") if spec else []
    core = core_for(addrs[0]) if len(addrs) == 1 else None
    return bool(core is not None and core.store.plain)


def ask(core: Any, op: ops.Op, job: str, keys: Sequence, opts: dict[str, Any]) -> Any:
    """An operation of ServerClient's on a server in this process: gets, puts,
    look-ups and claims straight to the core (which checks the ids as it does for
    the wire; a look-up of the sampler's window packed into a frame and split again
    cost twice the look-up), the others through the op's own frame and serve,
    without a socket. Failures come back as they would over the wire: RemoteError,
    BAD_REQUEST or INTERNAL (dataplane.py)."""
    try:
        if op is ops.GET:
            return core.get(job, keys)
        if op is ops.PUT:
            return put(core, job, keys, **opts)
        if op is ops.LOOKUP:
            return core.lookup(job, keys, **opts)
        if op is ops.CLAIM:
            return core.claim(job, keys)
        count, parts, flags = op.frame(keys, **opts)
        rcount, answer = op.serve(core, job, flags, count, memoryview(b"".join(parts)))
        return op.result(rcount, b"".join(answer))
    except BadRequest as e:
        raise wire.RemoteError(wire.BAD_REQUEST, str(e)) from None
    except Exception as e:  # as the data plane answers: the client takes the server as failed
        raise wire.RemoteError(wire.INTERNAL, f"internal error: {e}") from e


def put(core: Any, job: str, items: Sequence[tuple[bytes, Any]], dataset: str = "", chunk: int = -1,
        replace: bool = False, vouch: bool = False) -> tuple[int, int, int]:
    """A put by this process: (stored, already, rejected_full). With `vouch` (only for
    values sealed from items just checked against the digest) the ids it wrote are
    vouched for; any other put makes the core forget its ids, as one over the wire."""
    return core.put(job, [(k, len(v), v) for k, v in items], dataset, chunk if dataset else -1, replace,
                    vouch=vouch)


def get_vouched(core: Any, job: str, ids: Sequence[bytes]) -> tuple[list, list[bool], Since]:
    """(values, vouched, since): vouched[i] when the value was put or checked by this
    process and nobody else has written it since; `since` for vouch() afterwards. The
    record checksum (xxh3) is skipped: the caller opens every value with its AES-GCM tag,
    which any change to the stored bytes fails (it then replaces the value). For a
    sealed store: a plain one's values need no vouching (get_plain)."""
    since, vouched = core.trust.begin(ids)
    values = core.get(job, ids, trailer=False)
    if not core.trust.still(since):  # someone else wrote meanwhile: check them all, vouch none
        return values, [False] * len(ids), None
    return values, [v and x is not None for v, x in zip(vouched, values)], since


def get_plain(core: Any, job: str, ids: Sequence[bytes]) -> list:
    """Values of a plain store (datadir.py): items this user's processes checked against
    their digests before putting them, read with RocksDB's block checksums on. Nothing
    to vouch for: the caller checks no hash (docs/security.md)."""
    return core.get(job, ids, trailer=False)


def vouch(core: Any, ids: Sequence[bytes], since: Since) -> None:
    """This process checked these ids' values, read after `since`, against its digest."""
    if ids:
        core.trust.vouch(ids, since)
