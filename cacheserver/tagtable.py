"""A store's tags (dataset, chunk): interned for its index, with the usage of each.

A tag lives while an entry has it or a put is writing under it (pinned), and
goes once neither holds: a server that sees dataset after dataset and chunk
after chunk keeps the tags of what it holds, not of all it ever held, as a
restart rebuilds them from the index records (storerecovery.py). Ids are never
reused, so a stale one fails loudly (KeyError) instead of naming another tag.
The store changes it with its lock held; usage() is read without that lock (gRPC
Stats, core._chunk_known), so that it never waits on a put that holds the lock
through a write stop (stallwrite.py): changes and usage() take the table's own
lock, held for no I/O. usage() is the table between two of its changes, not
between two of the store's: a put's entries may be partly counted, and an entry
being retagged counted under both tags for that instant; what its callers need
(a report; whether any entry holds a chunk) is not more exact than that.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

Tag = tuple[str, int]  # (dataset, chunk); ("", -1) is untagged
UNTAGGED: Tag = ("", -1)


def is_spare(tag: Tag) -> bool:
    """A dataset's item outside any chunk the manager gave space (chunk -1): it may
    only use room nobody else needs, so it is evicted first and evicts only its kind."""
    return tag[1] < 0 and tag[0] != ""


@dataclass
class TagUsage:
    items: int = 0
    bytes: int = 0


class TagTable:
    def __init__(self) -> None:
        self._tags: dict[int, Tag] = {}
        self._ids: dict[Tag, int] = {}
        self._usage: dict[int, TagUsage] = {}
        self._pins: dict[int, int] = {}  # tag id -> puts writing under it
        self._next = 0
        self._lock = threading.Lock()  # innermost: nothing is waited for while it is held

    def __len__(self) -> int:
        return len(self._tags)

    def __getitem__(self, tid: int) -> Tag:
        return self._tags[tid]

    def pin(self, tag: Tag) -> int:
        """The tag's id, kept until unpin() even while no entry has it (a put's write)."""
        with self._lock:
            tid = self._ids.get(tag)
            if tid is None:
                tid = self._ids[tag] = self._next
                self._tags[tid] = tag
                self._next += 1
            self._pins[tid] = self._pins.get(tid, 0) + 1
            return tid

    def unpin(self, tid: int) -> None:
        with self._lock:
            left = self._pins[tid] - 1
            if left:
                self._pins[tid] = left
            else:
                del self._pins[tid]
                self._drop_unused(tid)

    def add(self, tid: int, charge: int) -> None:
        """An entry of `charge` bytes took the tag (its id pinned or in use)."""
        with self._lock:
            if tid not in self._tags:
                raise KeyError(f"tag id {tid} is neither pinned nor in use")
            u = self._usage.get(tid)
            if u is None:
                u = self._usage[tid] = TagUsage()
            u.items += 1
            u.bytes += charge

    def remove(self, tid: int, charge: int) -> None:
        with self._lock:
            u = self._usage[tid]
            u.items -= 1
            u.bytes -= charge
            if u.items == 0:
                del self._usage[tid]
                self._drop_unused(tid)

    def _drop_unused(self, tid: int) -> None:  # the table's lock held
        if tid not in self._usage and tid not in self._pins:
            del self._ids[self._tags.pop(tid)]

    def matching(self, match: Callable[[Tag], bool]) -> set[int]:
        """With the store's lock held, as every change is: no lock of its own needed."""
        return {tid for tid, tag in self._tags.items() if match(tag)}

    def usage(self) -> dict[Tag, TagUsage]:
        """A copy: tag -> its entries' count and charges; needs no lock of the caller's."""
        with self._lock:
            return {self._tags[tid]: TagUsage(u.items, u.bytes) for tid, u in self._usage.items()}
