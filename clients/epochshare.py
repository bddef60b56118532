"""Which items an epoch walks: a rank's share of the dataset (DDP) and, when a run
resumes, the items its saved epoch had not yet delivered.

Both are filters on the epoch's items, applied before the sampler's walk:

    Share     rank r of W takes positions r, r+W, ... of a permutation seeded by
              (seed, epoch, n), as torch's DistributedSampler: padded with the
              permutation's first items to ceil(n/W) per rank, or cut to floor(n/W)
              with drop_last. Every rank computes the same permutation, so shares
              are disjoint (but for the padding) and cover every item.
    Progress  the batches the sampler issued, in order, and which of them the loader
              delivered to the training loop (workers prefetch, so issued is ahead);
              its state is the epoch in progress plus a bitmap of delivered items and
              the count of batches delivered (every rank's alike, where its items may
              not be: a transform's skipped items, preprocess/).

Progress's states: idle (no epoch started, or the last one delivered in full) ->
running (start) -> idle (every issued batch delivered after the last was issued, or
over(): the front end's epoch ended whole, items it left out included);
load() from any state -> resuming, whose next start() continues the saved epoch.
"""
from __future__ import annotations

import hashlib
import operator
from collections import deque

import numpy as np

STATE_VERSION = 1


class Share:
    """One rank's part of each epoch."""

    def __init__(self, n_items: int, seed: int, rank: int, world_size: int, drop_last: bool,
                 dataset: str = "") -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size; got rank={rank}, "
                             f"world_size={world_size}")
        if world_size > 1 and n_items < world_size:
            raise ValueError(f"the dataset has {n_items} items, fewer than world_size={world_size}: "
                             "every rank needs at least one")
        self.n, self.seed, self.rank, self.world, self.drop_last = n_items, seed, rank, world_size, drop_last
        self.dataset = dataset  # the digest's fingerprint (hex), where the sampler is told it

    @property
    def size(self) -> int:
        """Items per rank per epoch (the same on every rank)."""
        if self.world == 1:
            return self.n
        return self.n // self.world if self.drop_last else -(-self.n // self.world)

    def items(self, epoch: int) -> list[int] | None:
        """This rank's items in `epoch`; None when it has them all (world_size 1)."""
        if self.world == 1:
            return None
        # numpy: a million items in ~20 ms (random.shuffle takes ~0.6 s), the same in every process
        key = hashlib.sha256(f"mlcache-sampler/share/{self.seed}/{epoch}/{self.n}".encode()).digest()
        perm = np.random.default_rng(int.from_bytes(key[:8], "little")).permutation(self.n)
        total = self.size * self.world
        if total > self.n:  # pad from the start, as DistributedSampler does
            perm = np.concatenate([perm, perm[:total - self.n]])
        return perm[self.rank:total:self.world].tolist()

    def describe(self) -> dict:
        out = {"n_items": self.n, "seed": self.seed, "rank": self.rank, "world_size": self.world,
               "drop_last": self.drop_last}
        return {**out, "dataset": self.dataset} if self.dataset else out

    def check(self, state: dict) -> None:
        """A state saved by another run must describe the same dataset and split."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state of version {state.get('version')!r}; this client reads "
                             f"version {STATE_VERSION}")
        mine = self.describe()
        if self.world == 1:  # the order may change; the items left do not
            mine.pop("seed")
            mine.pop("drop_last")
        if "dataset" not in state:  # saved by a sampler that was not told its dataset
            mine.pop("dataset", None)
        wrong = [f"{k} {state.get(k)!r} (this loader: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if wrong:
            raise ValueError("the loader state was saved with " + ", ".join(wrong))


class Progress:
    """Issued and delivered batches of the epoch in progress."""

    def __init__(self, n_items: int) -> None:
        self.n = n_items
        self._epoch: int | None = None
        self._done = bytearray(0)
        self._issued: deque[list[int]] = deque()
        self._all_issued = False
        self._batches = 0  # batches delivered in the epoch
        # (epoch, delivered items, delivered batches or None: a state saved before they were counted)
        self._resume: tuple[int, bytearray, int | None] | None = None

    # -- the sampler -------------------------------------------------------
    def start(self, epoch: int) -> None:
        if self._resume is not None and self._resume[0] == epoch:
            self._done, self._batches = self._resume[1], self._resume[2] or 0
        else:
            self._done, self._batches = bytearray(self.n), 0
        self._resume = None
        self._epoch = epoch
        self._issued.clear()
        self._all_issued = False

    def issued(self, batch: list[int]) -> None:
        self._issued.append(batch)

    def issued_all(self) -> None:
        self._all_issued = True

    def remaining(self, epoch: int, items: list[int] | None) -> list[int] | None:
        """`items` (None: all) less those the state being resumed had delivered."""
        if self._resume is None or self._resume[0] != epoch:
            return items
        done = self._resume[1]
        return [i for i in (range(self.n) if items is None else items) if not done[i]]

    def resumed(self, epoch: int) -> tuple[int, int | None]:
        """(items, batches) that the state to be resumed in `epoch` had delivered; (0, 0)
        when the next iteration of `epoch` starts it afresh (batches None: not counted)."""
        if self._resume is None or self._resume[0] != epoch:
            return 0, 0
        return sum(self._resume[1]), self._resume[2]

    # -- the loader --------------------------------------------------------
    def delivered(self) -> int:
        """Marks the oldest issued batch delivered; returns its size."""
        if not self._issued:
            return 0
        batch = self._issued.popleft()
        for i in batch:
            self._done[i] = 1
        self._batches += 1
        return len(batch)

    def delivered_items(self, items: list[int]) -> int:
        """Marks these items delivered (batches regrouped as items finish, preprocess/):
        issued batches leave the queue once all their items are. Returns len(items)."""
        for i in items:
            self._done[i] = 1
        self._batches += 1
        while self._issued and all(self._done[i] for i in self._issued[0]):
            self._issued.popleft()
        return len(items)

    def over(self) -> None:
        """The front end's epoch ended whole: what it left out of its batches (items a
        transform skipped, preprocess/) is over too, so a state saved now resumes into
        the next epoch, not into those items."""
        if self._epoch is not None:
            self._issued.clear()
            self._all_issued = True

    @property
    def running(self) -> bool:
        return self._epoch is not None and not (self._all_issued and not self._issued)

    def state(self, next_epoch: int) -> dict:
        """The epoch to run next and the items of it already delivered."""
        batches: int | None
        if self._resume is not None:
            epoch, done, batches = self._resume
        elif self.running:
            epoch, done, batches = self._epoch, self._done, self._batches
        else:
            epoch, done, batches = next_epoch, None, 0
        packed = b"" if done is None else np.packbits(np.frombuffer(bytes(done), np.uint8)).tobytes()
        out = {"version": STATE_VERSION, "epoch": epoch, "delivered": packed,
               "items_delivered": 0 if done is None else sum(done)}
        return out if batches is None else {**out, "batches_delivered": batches}

    def check(self, state: dict) -> None:
        """A state's progress must be whole: a bitmap cut short read as "not delivered" (numpy pads
        it with zeros), so the resumed epoch yielded those items again; other damage surfaced as a
        bare KeyError or a numpy error. ValueError naming the field, before anything is loaded."""
        if "epoch" not in state:
            raise ValueError(f"the loader state has no 'epoch' (its keys: {sorted(map(str, state))})")
        for key in ("epoch", "items_delivered", "batches_delivered"):
            value = state.get(key, 0)
            try:
                whole = operator.index(value)
            except TypeError:
                raise ValueError(f"the loader state's {key!r} must be an integer, got {value!r}") from None
            if key != "epoch" and whole < 0:
                raise ValueError(f"the loader state's {key!r} must be >= 0, got {whole}")
        packed = state.get("delivered", b"")
        if not isinstance(packed, (bytes, bytearray)):
            raise ValueError(f"the loader state's 'delivered' must be bytes (a bitmap), got {type(packed).__name__}")
        if not packed:
            return
        if len(packed) != (self.n + 7) // 8:
            raise ValueError(f"the loader state's 'delivered' bitmap has {len(packed)} bytes; one of {self.n} items "
                             f"has {(self.n + 7) // 8}: the state is damaged")
        bits = np.unpackbits(np.frombuffer(bytes(packed), np.uint8))
        if bits[self.n:].any():
            raise ValueError(f"the loader state's 'delivered' bitmap marks items past the last ({self.n - 1}): "
                             f"the state is damaged")
        if "items_delivered" in state and int(bits.sum()) != state["items_delivered"]:
            raise ValueError(f"the loader state's 'items_delivered' {state['items_delivered']} does not match its "
                             f"'delivered' bitmap ({int(bits.sum())} items): the state is damaged")

    def load(self, state: dict) -> int:
        """Take a saved state (checked: check()); returns the epoch the next iteration runs."""
        self.check(state)
        epoch, packed = operator.index(state["epoch"]), state.get("delivered", b"")
        if packed:
            bits = np.unpackbits(np.frombuffer(bytes(packed), np.uint8), count=self.n)
            batches = state.get("batches_delivered")
            self._resume = (epoch, bytearray(bits.tobytes()), None if batches is None else int(batches))
        else:
            self._resume = None
        self._epoch, self._issued = None, deque()
        return epoch


def outside(n: int, items: list[int], done: int) -> bytearray:
    """Per-item states for a walk over `items`: the others start as `done`."""
    if len(items) == n:
        return bytearray(n)
    state = np.full(n, done, np.uint8)
    state[np.asarray(items, np.int64)] = 0
    return bytearray(state.tobytes())
