"""Fallback eviction when the store is full and the manager has not made room.

A policy sees admissions, hits and removals and names victims; the store does
the deleting and the accounting. The manager (manager/) directs eviction by
chunk and dataset through the chunk calls; these policies only cover the gap.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def admitted(self, key: bytes) -> None: ...
    def accessed(self, key: bytes) -> None: ...
    def removed(self, key: bytes) -> None: ...
    def victims(self, protected: Callable[[bytes], bool]) -> Iterator[bytes]:
        """Candidates to evict, best first, skipping keys `protected` says to keep."""
        ...


class LRUPolicy:
    """Least recently used first; entries of referenced chunks are kept."""

    name = "lru"
    MAX_SCAN = 100_000  # bound the walk past protected entries per request

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def admitted(self, key: bytes) -> None:
        self._order[key] = None

    def accessed(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self, protected: Callable[[bytes], bool]) -> Iterator[bytes]:
        # Protected keys move to the back, so repeated scans stay cheap.
        for _ in range(min(self.MAX_SCAN, len(self._order))):
            if not self._order:
                return
            key = next(iter(self._order))
            if protected(key):
                self._order.move_to_end(key)
                continue
            yield key  # the store removes it (removed()) before asking again


class NoEviction:
    """Refuse puts when full: space is freed only by manager-directed eviction."""

    name = "none"

    def admitted(self, key: bytes) -> None: ...
    def accessed(self, key: bytes) -> None: ...
    def removed(self, key: bytes) -> None: ...

    def victims(self, protected: Callable[[bytes], bool]) -> Iterator[bytes]:
        return iter(())


POLICIES: dict[str, type] = {"lru": LRUPolicy, "none": NoEviction}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
