"""Batch sampler with substitutable hits and co-operative misses (Quiver §4.7, §5.2).

Per epoch the sampler walks a seeded random permutation:

    pending  = the permutation (items not yet yielded this epoch)
    step:    window = next L = lookahead x batch_size pending items
             present = lookup(window)            # cheap batched Lookup
             ready  += hits of the window, in order
             misses go to the back of pending    # deferred to a later pass
             batch  = batch_size items from ready;
                      if ready runs short, the rest are window misses in
                      random order (co-operative: concurrent jobs with other
                      permutations pick other misses, fetch and insert them,
                      and each finds the others' inserts as hits)
    repeat until pending and ready are empty.

Invariants: every item is yielded exactly once per epoch, whatever the cache
holds or loses; every batch but the last is full; a failed lookup counts as
all-miss (progress never depends on the cache). Better than the paper's
sampler in two ways: hits found beyond the current batch are kept for the next
batches instead of being looked up again, and misses are preferred from the
chunk being loaded (see `prefer`), so jobs load the next chunk together.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

Lookup = Callable[[Sequence[int]], Sequence[bool]]


@dataclass
class SamplerStats:
    """Main-process view of an epoch: what lookups promised (workers count actual reads)."""
    epoch: int = 0
    batches: int = 0
    items: int = 0
    looked_up: int = 0
    planned_hits: int = 0      # items yielded because a lookup found them cached
    planned_misses: int = 0    # items yielded as co-operative misses
    substituted: int = 0       # misses deferred so a cached item could take their place
    passes: int = 0            # times the walk wrapped around the pending items
    lookup_failures: int = 0
    pending_at_end: int = 0
    history: list = field(default_factory=list)

    @property
    def planned_hit_rate(self) -> float:
        return self.planned_hits / self.items if self.items else 0.0


class SubstitutableBatchSampler:
    """A batch sampler (iterable of index lists) for torch DataLoader's batch_sampler."""

    def __init__(self, n_items: int, batch_size: int, lookup: Lookup | None, *, seed: int = 0,
                 lookahead: int = 10, drop_last: bool = False,
                 prefer: Callable[[int], bool] | None = None,
                 on_batch: Callable[[list[int]], None] | None = None) -> None:
        if n_items < 0 or batch_size < 1 or lookahead < 1:
            raise ValueError(f"need n_items >= 0, batch_size >= 1, lookahead >= 1; "
                             f"got {n_items}, {batch_size}, {lookahead}")
        self.n_items = n_items
        self.batch_size = batch_size
        self.lookup = lookup
        self.seed = seed
        self.lookahead = lookahead
        self.drop_last = drop_last
        self.prefer = prefer
        self.on_batch = on_batch
        self.epoch = 0
        self.stats = SamplerStats()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.n_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _present(self, window: list[int]) -> Sequence[bool]:
        if self.lookup is None:
            return [False] * len(window)
        try:
            present = self.lookup(window)
        except Exception:  # the cache is an optimisation: never fail the epoch for it
            self.stats.lookup_failures += 1
            return [False] * len(window)
        if len(present) != len(window):
            raise RuntimeError(f"lookup answered {len(present)} flags for {len(window)} items")
        return present

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch += 1  # a DataLoader that never calls set_epoch still reshuffles
        rng = random.Random(hash((self.seed, epoch)))
        order = list(range(self.n_items))
        rng.shuffle(order)
        stats = self.stats = SamplerStats(epoch=epoch)
        pending: deque[int] = deque(order)
        ready: deque[int] = deque()
        B, L = self.batch_size, self.batch_size * self.lookahead
        pass_left = len(pending)  # items left to examine before this pass wraps
        while pending or ready:
            if len(ready) < B and pending:
                window = [pending.popleft() for _ in range(min(L, len(pending)))]
                pass_left -= len(window)
                present = self._present(window)
                stats.looked_up += len(window)
                misses = []
                for i, hit in zip(window, present):
                    (ready if hit else misses).append(i)
                batch = [ready.popleft() for _ in range(min(B, len(ready)))]
                stats.planned_hits += len(batch)
                if len(batch) < B and misses:
                    rng.shuffle(misses)  # co-operative: jobs pick different misses
                    if self.prefer is not None:  # stable sort keeps the random order per group
                        misses.sort(key=lambda i: not self.prefer(i))
                    take = B - len(batch)
                    batch += misses[:take]
                    stats.planned_misses += len(misses[:take])
                    misses = misses[take:]
                stats.substituted += len(misses)
                pending.extend(misses)  # deferred to a later pass
                if pass_left <= 0:
                    stats.passes += 1
                    pass_left = len(pending)
            else:
                batch = [ready.popleft() for _ in range(min(B, len(ready)))]
                stats.planned_hits += len(batch)
            # A batch is short only when nothing is left: windows hold >= B items otherwise.
            if len(batch) < B and self.drop_last:
                stats.pending_at_end = len(batch)
                break
            stats.batches += 1
            stats.items += len(batch)
            if self.on_batch is not None:
                self.on_batch(batch)
            yield batch
