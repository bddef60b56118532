"""One epoch of the sampler's default walk: a front in the shared order plus a
general scan of the job's own order (clients/sampler.py explains why).

Item states (`state[i]`), one way only within an epoch:

    PENDING --looked up, a miss--> SEEN
    PENDING or SEEN --looked up, a hit--> READY --taken into a batch--> DONE
    SEEN --taken into a batch as a miss--> DONE

Invariants, true between steps:
  * `left` counts the PENDING and SEEN items, `waiting` the SEEN ones;
  * `ready` holds exactly the READY items, each step's finds shuffled (seeded);
  * `front` holds PENDING or SEEN items only (DONE and READY ones are dropped
    when the front is rebuilt), each marked `infront`; an item marked
    `infront` is never looked up by the general scan, so no item is looked
    up twice in one step; a jump clears the marks of the front it leaves;
  * `general_q` holds every item not yet DONE or READY at most once (a stale
    entry is dropped when met), in this job's own rotating order;
  * a batch takes READY items from `ready` first, then SEEN items as misses,
    so every item is yielded exactly once and each batch but the last is full.
"""
from __future__ import annotations

import random
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from cacheserver.vocab import HIT, PENDING

from .epochshare import outside

PENDING_, SEEN, READY, DONE = 0, 1, 2, 3   # item states (PENDING_: not looked up; vocab.PENDING is an answer)
FRONT_SHARE = 0.9      # share of the look-ups that re-examine the front while it pays
GENERAL_SHARE = 0.9    # share that goes to the general scan while the front does not
SMOOTHING = 0.3        # weight of the latest step in the smoothed hit yields
JUMP_AFTER = 2         # a jump needs this many general hits within one front's span
JUMP_COOLDOWN = 2      # steps between jumps
JUMP_MIN_FRONTS = 2    # and only to a place more than this many fronts ahead
JUMP_WARMUP = 3        # and not in an epoch's first steps


class Walked(Protocol):
    """What the walk needs of its sampler (SubstitutableBatchSampler)."""
    n_items: int
    batch_size: int
    lookahead: int
    seed: int
    stats: Any
    _cursor: int
    _salt: int

    def shared_order(self) -> tuple[array, array]: ...

    def _present(self, window: list[int]) -> Sequence[int]: ...


class FrontWalk:
    def __init__(self, sampler: Walked, rng: random.Random, items: Sequence[int]) -> None:
        """`items`: this epoch's walk (a rank's share, less what a resumed state had
        delivered); the others start DONE."""
        self.s, self.stats = sampler, sampler.stats
        n = self.n = sampler.n_items
        self.B, self.L = sampler.batch_size, sampler.batch_size * sampler.lookahead
        self.order, self.rank = sampler.shared_order()
        own = list(items)
        rng.shuffle(own)
        self.rng = rng                             # this job's randomness for the epoch (seeded)
        self.picker = random.Random(f"{sampler.seed}/{self.stats.epoch}/{sampler._salt}")
        self.general_q: deque[int] = deque(own)   # this job's own order, rotating
        self.state = outside(n, own, DONE)
        self.infront = bytearray(n)                # taken into the front (stays set until a jump)
        self.ready: deque[int] = deque()           # READY items, not yet yielded
        self.front: list[int] = []                 # PENDING/SEEN items in shared order from the cursor
        # an epoch starts where the last one's front had got to: jobs that went round
        # together stay together (and a new job starts at 0, where others started)
        self.cursor = sampler._cursor % n if n else 0
        self.nxt, self.pulled = self.cursor, 0     # where the front fills from; how far it went
        self.left = len(own)                       # PENDING and SEEN items
        self.waiting = 0                           # SEEN items
        self.share = FRONT_SHARE
        self.front_yield = self.general_yield = 0.0  # smoothed hits per look-up
        self.since_jump = -JUMP_WARMUP  # epochs end at slightly different times: let the others arrive

    def batches(self) -> Iterator[list[int]]:
        while self.left or self.ready:
            if len(self.ready) >= self.B or not self.left:
                yield self._take_ready()
                continue
            window, nf = self._fill_front()
            general = self._general(window)
            if len(general) < min(self.L - len(window), self.left - len(window)):
                window = self.front[:self.L - len(general)]  # everything left is in the front
            front_misses, general_misses, general_hits, others = self._look(window, general)
            self._maybe_jump(general_hits, nf)
            yield self._batch(front_misses, general_misses, others)

    def _take_ready(self) -> list[int]:
        batch = [self.ready.popleft() for _ in range(min(self.B, len(self.ready)))]
        self.stats.planned_hits += len(batch)
        self.stats.substituted += min(len(batch), self.waiting)
        self._yielded(batch)
        return batch

    def _fill_front(self) -> tuple[list[int], int]:
        """Drop what left the front, top it up from the shared order; (window, its size)."""
        state, infront = self.state, self.infront
        self.front = [i for i in self.front if state[i] <= SEEN]
        nf = max(1, round(self.L * self.share))
        while len(self.front) < nf and self.pulled < self.n:
            i = self.order[self.nxt]
            self.nxt += 1
            self.pulled += 1
            if self.nxt == self.n:
                self.nxt = 0
                self.stats.passes += 1
            if state[i] <= SEEN and not infront[i]:
                self.front.append(i)
                infront[i] = 1
        self.s._cursor = self.nxt
        return self.front[:nf], nf

    def _general(self, window: list[int]) -> list[int]:
        """The next pending items of this job's own order, outside the front."""
        general: list[int] = []
        want = min(self.L - len(window), self.left - len(window))
        spins = len(self.general_q)
        while len(general) < want and spins > 0:
            spins -= 1
            i = self.general_q.popleft()
            if self.state[i] > SEEN:
                continue  # yielded or ready meanwhile: drop it
            self.general_q.append(i)  # examined now: to the back
            if not self.infront[i]:
                general.append(i)
        return general

    def _look(self, window: list[int], general: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Look up window + general and move each item on; the misses of the
        front, of the general scan, those another job is reading, and the general hits."""
        state, nw = self.state, len(window)
        looked = window + general
        rescanned = [state[i] == SEEN for i in window]
        present = self.s._present(looked)
        self.stats.looked_up += len(looked)
        front_misses, general_misses, general_hits, others, found = [], [], [], [], []
        rh = rn = gh = gn = 0
        for k, (i, code) in enumerate(zip(looked, present)):
            hit = code == HIT
            if k < nw and rescanned[k]:
                rn += 1
                rh += hit
            else:
                gn += 1
                gh += hit
            if hit:
                self.waiting -= state[i] == SEEN
                state[i] = READY
                found.append(i)
                self.left -= 1
                if k >= nw:
                    general_hits.append(i)
            else:
                self.waiting += state[i] != SEEN
                state[i] = SEEN
                if code == PENDING:
                    others.append(i)  # another job is reading it: a hit soon
                else:
                    (front_misses if k < nw else general_misses).append(i)
        # the front walks the shared order: shuffle what it found, or a cached dataset
        # would come in the same order every epoch and for every job
        self.rng.shuffle(found)
        self.ready.extend(found)
        self._adapt(rh, rn, gh, gn)
        return front_misses, general_misses, general_hits, others

    def _adapt(self, rh: int, rn: int, gh: int, gn: int) -> None:
        """Does re-examining the front pay (others insert there) or is the cache
        warm elsewhere (a filled cache, or the other jobs are elsewhere)?"""
        a = SMOOTHING
        if rn:
            self.front_yield = (1 - a) * self.front_yield + a * rh / rn
        if gn:
            self.general_yield = (1 - a) * self.general_yield + a * gh / gn
        self.since_jump += 1
        self.share = 1 - GENERAL_SHARE if self._elsewhere() else FRONT_SHARE

    def _elsewhere(self) -> bool:
        return self.general_yield > 2 * self.front_yield

    def _maybe_jump(self, general_hits: list[int], nf: int) -> None:
        """Jump only to others well ahead: a job just a little behind them still
        meets their inserts in its front, and leaving it would strand its pending items."""
        if not (self._elsewhere() and self.since_jump > JUMP_COOLDOWN and len(general_hits) >= JUMP_AFTER):
            return
        n, front = self.n, self.front
        span = int(self.L * FRONT_SHARE * n / max(1, self.left))  # ranks a full front covers
        # where the front is: its middle (a few old misses may linger at its start)
        here = self.rank[front[len(front) // 2]] if front else self.cursor
        to = cluster(general_hits, self.rank, here, n, span)
        if to is None or (to - here) % n <= JUMP_MIN_FRONTS * span:
            return
        self.stats.history.append(dict(event="jump", batch=self.stats.batches, left=self.left, at=here, to=to,
                                       front_yield=round(self.front_yield, 4),
                                       general_yield=round(self.general_yield, 4)))
        self.cursor = (to - nf // 2) % n  # join the others: the front restarts there
        for i in front:
            self.infront[i] = 0
        self.front = []
        self.nxt, self.pulled = self.cursor, 0
        self.front_yield = self.general_yield
        self.since_jump = 0
        self.stats.jumps += 1

    def _batch(self, front_misses: list[int], general_misses: list[int], others: list[int]) -> list[int]:
        """Known hits first; then misses, co-operatively: jobs pick different ones, at random."""
        B, stats = self.B, self.stats
        batch = [self.ready.popleft() for _ in range(min(B, len(self.ready)))]
        hits = len(batch)
        stats.planned_hits += hits
        if len(batch) < B:
            take: list[int] = []
            for misses in (front_misses, general_misses, others):  # in this order, each at random
                k = min(B - len(batch) - len(take), len(misses))
                if k > 0:  # k draws, not a shuffle of the whole window
                    take += self.picker.sample(misses, k)
            self.left -= len(take)
            batch += take
            stats.planned_misses += len(take)
            self.waiting -= len(take)  # SEEN items, yielded now
        stats.substituted += min(hits, self.waiting)  # each hit went ahead of a waiting miss
        self._yielded(batch)
        return batch

    def _yielded(self, batch: list[int]) -> None:
        for i in batch:
            self.state[i] = DONE


def cluster(hits: list[int], rank: array, cursor: int, n: int, span: int) -> int | None:
    """Rank where most of `hits` lie within `span` ranks (the nearest such place ahead
    of the cursor), or None if no two do."""
    rel = sorted((rank[i] - cursor) % n for i in hits)
    best, at, hi = 1, None, 0
    for lo in range(len(rel)):
        while hi < len(rel) and rel[hi] - rel[lo] <= span:
            hi += 1
        if hi - lo > best:
            best, at = hi - lo, rel[lo]
    return None if at is None else (cursor + at) % n
