"""Batch sampler with substitutable hits and co-operative misses (Quiver §4.7, §5.2).

Each batch is filled with items a cheap batched Lookup found cached first
(substitutable hits); only the rest are misses, which the loader reads from
the store and inserts, so that concurrent jobs on the same dataset find them
as hits (co-operative misses). Per step, while fewer than a batch of known
hits is ready, the sampler looks up L = lookahead x batch_size pending items:

    front    the pending items that come first in a circular order of the
             dataset that every job shares (seeded by the item count only),
             starting at this job's cursor; they are looked up again every
             step, hits and misses alike
    general  the next pending items of this job's own random order of the
             epoch (rotating; misses go to the back), to find cached items
             anywhere else

    batch  = known hits first; then misses taken at random from the front
             (then from the general part)

Why a shared order: with a cache of ~10% of the dataset, an item one job
fetched lives in the LRU cache for about as long as it takes each job to
consume 10% of the dataset. If every job picked its misses from its own
permutation (the paper's sampler), another job would find the item only if
its own look-ahead happened to pass over it in that time, which with the
default lookahead of 10 it does only about half the time: 4 jobs read 1.35x
the dataset from the store per epoch (tools/bench/partial, "walk"). Here the
jobs pick their misses from the same front of the shared order and
re-examine that front every step, so they find each other's inserts within a
step or two and nothing is evicted unread: 1.1-1.2x, the excess being two
jobs picking the same miss while its read is in flight, which drops as the
front grows relative to the reads in flight (~1.01x with 20,000 items in
tools/bench/samplersim; docs/benchmarks.md). Which misses a job picks
is random per sampler, not derived from the seed, so jobs of a sweep that
share a seed still pick different ones.

Joining the others: a job whose general look-ups find more hits than its
front (it started late, or the others ran ahead) moves its front to where
those hits cluster in the shared order, i.e. to where the others are loading,
if that is more than two fronts ahead (a job a little behind still meets the
others' inserts in its own front) and not in an epoch's first steps. An epoch
starts where the front of the last one had got to, so jobs that went round
together stay together. Jobs whose speeds differ by more than the cache's
share of the dataset per epoch drift apart regardless; the front then helps
less, and staggered jobs fare about as with the paper's sampler (simulated).

Budget: the front gets 90% of the look-ups while re-examining it finds the
others' inserts, 10% when the general look-ups find more (a cache filled
earlier, no other job): then the sampler mostly substitutes hits found
anywhere, as in the paper.

Randomness: a job's epoch is a walk round a dataset-wide circular order,
shuffled locally within the ~L items of the front (plus whatever hits the
cache offers), like Quiver's per-chunk shuffling but at a finer grain: an
item meets much the same neighbours in every epoch. `walk=True` walks the
job's own permutation as the paper does instead (a baseline for benchmarks),
taking misses that `prefer` names (a chunk hint: the chunk being loaded)
first. The shared order ignores `prefer`: one preference common to all jobs
makes them pick the same misses at once (simulated: 1.40x store reads
against 1.21x), and the manager's prefetcher loads that chunk anyway. With
no lookup (substitute=False) the epoch is a plain permutation.

Shares and resume filter the epoch's items before the walk, which then sees only
them (the others count as already yielded):
    rank/world_size  a rank's share is its disjoint part of a permutation seeded by
             (seed, epoch), as torch's DistributedSampler: padded with items from
             its start so every rank gets ceil(n/W) (drop_last: cut to floor(n/W)),
             hence the same number of batches on every rank
    resume   load_state_dict() of a state taken mid-epoch: that epoch again, minus
             the items of the batches delivered before the state was taken

Invariants: every item (of the share) is yielded exactly once per epoch, whatever
the cache holds or loses; every batch but the last is full; a failed lookup counts as
all-miss (progress never depends on the cache).
"""
from __future__ import annotations

import operator
import os
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cacheserver.vocab import HIT, PENDING

from .ddpseed import check_same_seed
from .epochshare import Progress, Share
from .frontwalk import FrontWalk
from .procstate import DatasetClosed

# A look-up answers per item (vocab.py): HIT (or True) cached, 0 (False) not,
# PENDING not cached but another job is reading it from the store now (it will
# be a hit soon, so it is the last choice for a miss).
Lookup = Callable[[Sequence[int]], Sequence[int]]

@dataclass
class SamplerStats:
    """Main-process view of an epoch: what lookups promised (workers count actual reads)."""
    epoch: int = 0
    batches: int = 0
    items: int = 0             # items of the batches issued (workers prefetch: may run ahead)
    delivered_items: int = 0   # items of the batches the loader handed to the training loop
    looked_up: int = 0
    planned_hits: int = 0      # items yielded because a lookup found them cached
    planned_misses: int = 0    # items yielded as co-operative misses
    substituted: int = 0       # hits yielded while a miss the sampler had met waited (<= planned_hits)
    passes: int = 0            # times the walk wrapped around (front: the shared circle)
    jumps: int = 0             # times the front moved to where the cache was warm
    lookup_failures: int = 0
    pending_at_end: int = 0
    history: list = field(default_factory=list)  # notable events (jumps), as dicts

    @property
    def planned_hit_rate(self) -> float:
        return self.planned_hits / self.items if self.items else 0.0


def whole(name: str, value: Any) -> int:
    """An integer argument as an int (numpy's and torch's integers too); else a TypeError
    naming it, not one from deep inside the first epoch (None, 2.5, "8")."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


class SubstitutableBatchSampler:
    """A batch sampler (iterable of index lists) for torch DataLoader's batch_sampler."""

    def __init__(self, n_items: int, batch_size: int, lookup: Lookup | None, *, seed: int = 0,
                 lookahead: int = 10, drop_last: bool = False,
                 prefer: Callable[[int], bool] | None = None,
                 on_batch: Callable[[list[int]], None] | None = None,
                 miss_seed: int | None = None, walk: bool = False,
                 on_epoch: Callable[[Sequence[int] | None], None] | None = None,
                 rank: int = 0, world_size: int = 1, dataset: str = "") -> None:
        # ints, not numpy's or torch's: the state holds the seed and epoch (torch.load(weights_only=True))
        n_items, batch_size, lookahead, rank, world_size, seed = (
            whole(k, v) for k, v in (("n_items", n_items), ("batch_size", batch_size), ("lookahead", lookahead),
                                     ("rank", rank), ("world_size", world_size), ("seed", seed)))
        if isinstance(drop_last, (str, bytes)):  # "False" from a config file would be true
            raise TypeError(f"drop_last must be a bool, got {drop_last!r}")
        drop_last = bool(drop_last)
        if n_items < 0 or batch_size < 1 or lookahead < 1:
            raise ValueError(f"need n_items >= 0, batch_size >= 1, lookahead >= 1; "
                             f"got {n_items}, {batch_size}, {lookahead}")
        self.share = Share(n_items, seed, rank, world_size, drop_last, dataset)
        check_same_seed(dataset, seed, rank, world_size,  # under torch.distributed: ddpseed.py
                        loader={"n_items": n_items, "batch_size": batch_size, "drop_last": drop_last})
        self.progress = Progress(n_items)
        self.n_items = n_items
        self.batch_size = batch_size
        self.lookup = lookup
        self.seed = seed
        self.lookahead = lookahead
        self.drop_last = drop_last
        self.prefer = prefer
        self.walk = walk  # the paper's walk over this job's own permutation (a baseline)
        self.on_batch = on_batch
        self.on_epoch = on_epoch  # told each epoch's items (None: all) before its first batch
        self.epoch = 0
        self.stats = SamplerStats()
        self._shared: tuple[array, array] | None = None
        self._cursor = 0  # where the front had got to in the shared order (carried over)
        # Which misses this job picks must differ from job to job even when their seeds are
        # equal (a hyper-parameter sweep often fixes the seed): drawn per sampler unless
        # miss_seed fixes it (a reproducible run, given the same cache contents).
        self._salt = int.from_bytes(os.urandom(8), "little") if miss_seed is None else miss_seed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = whole("epoch", epoch)

    def __len__(self) -> int:
        """Batches the next iteration yields (after a resumed state's, _left)."""
        return self._left(*self.progress.resumed(self.epoch))

    def _left(self, items: int, batches: int | None) -> int:
        """Batches of the epoch to come after `items` in `batches` were delivered. Under DDP
        the epoch's, less those delivered (the same on every rank, which a front end that
        leaves items out, a transform's on_error="skip", keeps to: clients/loader.py); alone
        those the items left make, which the walk yields (skipped items are tried again)."""
        if batches is None or self.share.world == 1:
            return self._batches(self.share.size - items)
        return max(0, self._batches(self.share.size) - batches)

    def _batches(self, n: int) -> int:
        """Batches that n items make."""
        full, rest = divmod(n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def delivered(self) -> None:
        """The loader handed the oldest batch not yet handed over to the training loop."""
        self.stats.delivered_items += self.progress.delivered()

    def delivered_items(self, items: list[int]) -> None:
        """The loader handed these items to the training loop, in a batch of its own
        making (the preprocess scheduler regroups items as they finish)."""
        self.stats.delivered_items += self.progress.delivered_items(items)

    def state_dict(self) -> dict:
        """Where the job is: the epoch in progress and the items already delivered in it.
        An epoch with no batch left (saved at its last batch, before the loop saw its end:
        without workers the sampler is not yet exhausted then) is over: the state resumes
        into the next one, with or without workers, as torchdata's StatefulDataLoader."""
        st = self.progress.state(self.epoch)
        if st["delivered"] and (self._batches(self.share.size - st["items_delivered"]) == 0
                                or self._left(st["items_delivered"], st.get("batches_delivered")) == 0):
            st = {**st, "epoch": st["epoch"] + 1, "delivered": b"", "items_delivered": 0, "batches_delivered": 0}
        return {**self.share.describe(), **st, "batch_size": self.batch_size}

    def epoch_over(self) -> None:
        """The front end ended the epoch whole (Progress.over)."""
        self.progress.over()

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the next iteration runs the saved epoch's other items."""
        self.share.check(state)
        self.progress.check(state)  # before its counts are used below
        if state.get("batch_size") != self.batch_size or "batches_delivered" not in state:
            # its batches are not ours, or not counted (an older version's state): as many as its
            # items make, from which the count goes on (a count from 0 padded DDP ranks with repeats)
            n, items = self.share.size, int(state.get("items_delivered", 0))
            state = {**state, "batches_delivered": self._batches(n) - self._batches(n - items)}
        self.epoch = self.progress.load(state)
        if self.progress.resumed(self.epoch)[0] and len(self) == 0:
            # what it left makes no batch here (drop_last, a larger batch_size): that epoch is over, as
            # state_dict() says of one saved at its last batch; not an empty epoch
            self.epoch = self.progress.load({"epoch": self.epoch + 1})

    def epoch_items(self, epoch: int) -> list[int] | None:
        """This epoch's items for the walk, None for all: the rank's share, less what a
        resumed state had delivered."""
        items = self.share.items(epoch)
        return self.progress.remaining(epoch, items)

    def _present(self, window: list[int]) -> Sequence[bool]:
        if self.lookup is None:
            return [False] * len(window)
        try:
            present = self.lookup(window)
        except DatasetClosed:  # closed under the epoch: it ends, as the loader's next read would end it
            raise
        except Exception:  # the cache is an optimisation: never fail the epoch for it
            self.stats.lookup_failures += 1
            return [False] * len(window)
        if len(present) != len(window):
            raise RuntimeError(f"lookup answered {len(present)} flags for {len(window)} items")
        return present

    def shared_order(self) -> tuple[array, array]:
        """(order, rank): the circular order all jobs on a dataset of this size share."""
        if self._shared is None:
            n = self.n_items
            order = list(range(n))
            random.Random(f"mlcache-sampler/shared-order/{n}").shuffle(order)
            rank = array("q", bytes(8 * n))
            for r, i in enumerate(order):
                rank[i] = r
            self._shared = (array("q", order), rank)
        return self._shared

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch += 1  # a DataLoader that never calls set_epoch still reshuffles
        rng = random.Random(hash((self.seed, epoch)))
        self.stats = SamplerStats(epoch=epoch)
        items = self.epoch_items(epoch)
        if self.on_epoch is not None:
            self.on_epoch(items)
        self.progress.start(epoch)
        if items is None:
            items = range(self.n_items)
        if self.lookup is None:
            batches = self._plain(rng, items)
        elif self.walk:
            batches = self._walk(rng, items)
        else:
            batches = self._front(rng, items)
        for batch in batches:
            # A batch is short only when nothing is left: windows hold >= B items otherwise.
            if len(batch) < self.batch_size and self.drop_last:
                self.stats.pending_at_end = len(batch)
                break
            self.stats.batches += 1
            self.stats.items += len(batch)
            if self.on_batch is not None:
                self.on_batch(batch)
            self.progress.issued(batch)
            yield batch
        self.progress.issued_all()

    # ---- no cache: a plain permutation ----------------------------------
    def _plain(self, rng: random.Random, items: Sequence[int]) -> Iterator[list[int]]:
        order = list(items)
        rng.shuffle(order)
        for k in range(0, len(order), self.batch_size):
            batch = order[k:k + self.batch_size]
            self.stats.planned_misses += len(batch)
            yield batch

    # ---- with a chunk hint: the paper's walk over this job's permutation --
    def _walk(self, rng: random.Random, items: Sequence[int]) -> Iterator[list[int]]:
        """Windows over the pending items in this job's order; hits are kept, misses
        deferred to the back; preferred misses fill a short batch first."""
        stats = self.stats
        order = list(items)
        rng.shuffle(order)
        pending: deque[int] = deque(order)
        ready: deque[int] = deque()
        deferred, waiting = bytearray(self.n_items), 0  # misses met and put back; how many
        B, L = self.batch_size, self.batch_size * self.lookahead
        pass_left = len(pending)  # items left to examine before this pass wraps
        while pending or ready:
            if len(ready) < B and pending:
                window = [pending.popleft() for _ in range(min(L, len(pending)))]
                pass_left -= len(window)
                present = self._present(window)
                stats.looked_up += len(window)
                misses, being_read = [], set()
                for i, code in zip(window, present):
                    if code == HIT:
                        ready.append(i)
                        if deferred[i]:
                            deferred[i], waiting = 0, waiting - 1
                    else:
                        misses.append(i)
                        if code == PENDING:
                            being_read.add(i)
                batch = [ready.popleft() for _ in range(min(B, len(ready)))]
                hits = len(batch)
                stats.planned_hits += hits
                if len(batch) < B and misses:
                    rng.shuffle(misses)  # co-operative: jobs pick different misses
                    # stable: random within groups; preferred first, others' reads last
                    prefer = self.prefer or (lambda i: False)
                    misses.sort(key=lambda i: (not prefer(i), i in being_read))
                    take = B - len(batch)
                    batch += misses[:take]
                    stats.planned_misses += len(misses[:take])
                    for i in misses[:take]:
                        if deferred[i]:
                            deferred[i], waiting = 0, waiting - 1
                    misses = misses[take:]
                for i in misses:
                    if not deferred[i]:
                        deferred[i], waiting = 1, waiting + 1
                stats.substituted += min(hits, waiting)  # each hit went ahead of a waiting miss
                pending.extend(misses)  # deferred to a later pass
                if pass_left <= 0:
                    stats.passes += 1
                    pass_left = len(pending)
            else:
                batch = [ready.popleft() for _ in range(min(B, len(ready)))]
                stats.planned_hits += len(batch)
                stats.substituted += min(len(batch), waiting)
            yield batch

    # ---- default: a shared front plus a general scan (frontwalk.py) -------
    def _front(self, rng: random.Random, items: Sequence[int]) -> Iterator[list[int]]:
        return FrontWalk(self, rng, items).batches()
