"""Cache servers running inside this process (the embedded default), by address.

A client in the process that runs a server takes its gets straight from the
server's core (CacheCore.get: counted, ordered and bypassed exactly as over the
wire) instead of through its own socket and a RocksDB follower: no frames, no
copies, no server thread contending for the GIL. Only the process that
registered a server sees it: a forked DataLoader worker inherits this table,
but not the server's threads, so it goes through the socket as before.
"""
from __future__ import annotations

import os
import threading
from typing import Any

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
