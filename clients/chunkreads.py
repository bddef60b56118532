"""What one loader of a job has read of its epoch, per chunk of the manager's plan
(clients/coordination.py releases a chunk once every loader that holds it has read it).

A job may read one dataset through several loaders (train and eval, two batch sizes): each
loader's sampler is an epoch stream of its own, with its own items to read (a DDP rank's share,
what a resumed epoch has left) and its own items read. A stream holds the chunks it still has
items to read of while its epoch is in progress; one not in an epoch holds none."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from manager.manager_client import Plan


class ChunkReads:
    """One epoch stream's items read, counted per chunk in one chunking at a time: the
    manager may re-chunk mid-epoch, and counts of one chunking never stand for another's."""

    def __init__(self, n_items: int) -> None:
        self.n_items = n_items
        self.active = False  # an epoch in progress: it holds the chunks it has items left in
        self._read: np.ndarray | None = None  # items consumed this epoch
        self._consumed: Counter = Counter()  # chunk -> of its items in _read, in chunking _counted_as
        self._counted_as: tuple[int, int] | None = None  # (n_items, k)
        self._expected: np.ndarray | None = None  # items this epoch reads (None: all)
        self._chunk_reads: dict[tuple[int, int, int], int] = {}  # (n, k, chunk) -> of them in it

    def start(self) -> None:
        """A new epoch: nothing read yet."""
        self.active = True
        self._consumed.clear()
        if self._read is not None:
            self._read[:] = False

    def end(self) -> None:
        """The epoch ended (or stopped early): the stream holds no chunk until its next one."""
        self.active = False

    def expect(self, items: Sequence[int] | None) -> None:
        """The items this epoch reads (None: all)."""
        self.active = True
        if items is None:
            self._expected = None
        else:
            self._expected = np.zeros(self.n_items, bool)
            self._expected[np.asarray(items, np.int64)] = True
        self._chunk_reads.clear()

    def mark(self, batch: Sequence[int], plan: Plan | None, chunked: bool) -> None:
        """Mark the batch's items read (also under a full or no plan: a chunked one may
        follow) and, under a chunked plan, count those not read before in their chunks."""
        if self._read is None:
            self._read = np.zeros(self.n_items, bool)
        idx = np.unique(np.asarray(batch, np.int64))
        fresh = idx[~self._read[idx]]
        self._read[fresh] = True
        if not chunked or plan is None:
            return
        self._chunking(plan)
        for i in fresh:
            c = plan.chunk_of(int(i))
            if c in self._consumed:  # else counted from _read when first needed
                self._consumed[c] += 1

    def _chunking(self, plan: Plan) -> None:
        if self._counted_as != (plan.n_items, plan.k):  # re-chunked: counts of the old chunking mean nothing
            self._consumed.clear()
            self._counted_as = (plan.n_items, plan.k)

    def done(self, plan: Plan, c: int) -> bool:
        """Whether this epoch has read all of its items of chunk c (none to read: done)."""
        self._chunking(plan)
        if c not in self._consumed:
            read = self._read
            self._consumed[c] = 0 if read is None else sum(int(read[r.start:r.stop].sum()) for r in plan.members(c))
        return self._consumed[c] >= self._to_read(plan, c)

    def _to_read(self, plan: Plan, c: int) -> int:
        """How many items of chunk c this epoch reads."""
        key = (plan.n_items, plan.k, c)
        if key not in self._chunk_reads:
            ranges, want = plan.members(c), self._expected
            self._chunk_reads[key] = (sum(len(r) for r in ranges) if want is None
                                      else sum(int(want[r.start:r.stop].sum()) for r in ranges))
        return self._chunk_reads[key]
