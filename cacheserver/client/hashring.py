"""Consistent-hash ring with virtual nodes; positions from xxhash.

Pure and small so clients and servers route identically. Each node owns
`vnodes` points; a key belongs to the first point clockwise from xxh3(key).
Adding or removing one of N nodes moves about 1/N of the keys.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import xxhash

DEFAULT_VNODES = 160


def _point(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._nodes: tuple[str, ...] = tuple(sorted(set(nodes)))
        points = []
        for node in self._nodes:
            for i in range(vnodes):
                points.append((_point(f"{node}#{i}".encode()), node))
        points.sort()
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def node_for(self, key: bytes) -> str:
        if not self._keys:
            raise LookupError("the ring has no nodes")
        i = bisect.bisect_right(self._keys, _point(key))
        return self._owners[i % len(self._owners)]

    def route(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Group key positions by owning node, preserving order within a node."""
        if len(self._nodes) == 1:  # one server (the embedded default, or a host's own): no hashing
            return {self._nodes[0]: list(range(len(keys)))} if keys else {}
        out: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            out.setdefault(self.node_for(k), []).append(i)
        return out

    def describe(self) -> dict[str, float]:
        """Share of the hash space each node owns (for `cachectl ring`)."""
        if not self._keys:
            return {}
        share: dict[str, int] = {n: 0 for n in self._nodes}
        prev = self._keys[-1] - 2**64
        for p, owner in zip(self._keys, self._owners):
            share[owner] += p - prev
            prev = p
        return {n: s / 2**64 for n, s in share.items()}
