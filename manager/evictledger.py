"""EvictDatasets a cache server missed, kept across a manager restart.

The actuator remembers, per server address, the datasets whose EvictDataset has not
reached that server (the call is queued, failed or was dropped, or the server was out of
the ring), and repeats them first at the server's next reconcile: Stats cannot tell a re-planned
dataset's old chunk tags from the new plan's. That memory is journaled here: the model
keeps it as ``owed`` (address -> sorted datasets), set only by ``evictions_owed`` events
that carry the whole map as it stands, as ``workers`` events carry a job's whole policy.
Only datasets the state still knows are journaled: a forgotten one has no plan whose
tags its old entries could pass for, and its active chunk, the one pinned, is unpinned
by reconcile after the grace period (actuator._unpin); this keeps the map, and each
event, as small as the state's own datasets and servers.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

log = logging.getLogger("manager.evictledger")

Owed = dict[str, list[str]]  # as journaled: address -> sorted datasets, none empty


def checked(owed: Any) -> Owed:
    """An event's map, canonical (sorted, no empty entries); ValueError saying what is wrong."""
    if not isinstance(owed, Mapping):
        raise ValueError(f"owed must be an object of address -> datasets, got {type(owed).__name__}")
    out: Owed = {}
    for addr, datasets in owed.items():
        if not isinstance(addr, str) or not addr or isinstance(datasets, (str, bytes)) \
                or not isinstance(datasets, (list, tuple)) \
                or not all(isinstance(d, str) and d for d in datasets):
            raise ValueError(f"owed[{addr!r}] must list dataset names for a server address, got {datasets!r}")
        if datasets:
            out[addr] = sorted(set(datasets))
    return out


def journaled(owed: Mapping[str, Collection[str]], known: Collection[str]) -> Owed:
    """What of the actuator's map the state keeps: the datasets it still knows."""
    out = {addr: sorted(d for d in ds if d in known) for addr, ds in owed.items()}
    return {addr: ds for addr, ds in sorted(out.items()) if ds}


class StoreLedger:
    """The actuator's missed EvictDatasets on the manager's state store (state.py)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def saved(self) -> dict[str, set[str]]:
        return self.store.read(lambda m: {addr: set(ds) for addr, ds in m.owed.items()})

    def known_addresses(self) -> set[str]:
        """Every server address the state knows, in the ring or not: one out of it now was
        known before the restart, and must get what is decided while it is away."""
        return self.store.read(lambda m: {s.address for s in m.registry.servers.values()})

    def save(self, owed: Callable[[], Mapping[str, Collection[str]]]) -> None:
        """Journal the map ``owed()`` returns, read under the store's lock (so two threads
        saving at once journal in the order they read), if the state's differs."""
        with self.store.lock:
            want = journaled(owed(), self.store.model.datasets)
            if want != self.store.model.owed:
                self.store.submit({"type": "evictions_owed", "owed": want})
