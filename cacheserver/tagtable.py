"""A store's tags (dataset, chunk): interned for its index, with the usage of each.

A tag lives while an entry has it or a put is writing under it (pinned), and
goes once neither holds: a server that sees dataset after dataset and chunk
after chunk keeps the tags of what it holds, not of all it ever held, as a
restart rebuilds them from the index records (storerecovery.py). Ids are never
reused, so a stale one fails loudly (KeyError) instead of naming another tag.
Not thread-safe: the store calls it with its lock held.
"""
from __future__ import annotations

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

    def __len__(self) -> int:
        return len(self._tags)

    def __getitem__(self, tid: int) -> Tag:
        return self._tags[tid]

    def pin(self, tag: Tag) -> int:
        """The tag's id, kept until unpin() even while no entry has it (a put's write)."""
        tid = self._ids.get(tag)
        if tid is None:
            tid = self._ids[tag] = self._next
            self._tags[tid] = tag
            self._next += 1
        self._pins[tid] = self._pins.get(tid, 0) + 1
        return tid

    def unpin(self, tid: int) -> None:
        left = self._pins[tid] - 1
        if left:
            self._pins[tid] = left
        else:
            del self._pins[tid]
            self._drop_unused(tid)

    def add(self, tid: int, charge: int) -> None:
        """An entry of `charge` bytes took the tag (its id pinned or in use)."""
        if tid not in self._tags:
            raise KeyError(f"tag id {tid} is neither pinned nor in use")
        u = self._usage.get(tid)
        if u is None:
            u = self._usage[tid] = TagUsage()
        u.items += 1
        u.bytes += charge

    def remove(self, tid: int, charge: int) -> None:
        u = self._usage[tid]
        u.items -= 1
        u.bytes -= charge
        if u.items == 0:
            del self._usage[tid]
            self._drop_unused(tid)

    def _drop_unused(self, tid: int) -> None:
        if tid not in self._usage and tid not in self._pins:
            del self._ids[self._tags.pop(tid)]

    def matching(self, match: Callable[[Tag], bool]) -> set[int]:
        return {tid for tid, tag in self._tags.items() if match(tag)}

    def usage(self) -> dict[Tag, TagUsage]:
        """A copy: tag -> its entries' count and charges."""
        return {self._tags[tid]: TagUsage(u.items, u.bytes) for tid, u in self._usage.items()}
