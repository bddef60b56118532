"""Filling a batch's misses: read from the store, inserted, and shared with the other
jobs and processes that miss the same items (CachedDataset's miss path).

Across hosts a miss is claimed on its server first (cacheserver/claims.py): the job that
wins a claim reads and inserts the item, the others wait for its insert and take it from
the cache. A claimant that will not insert what it claimed gives its claims up, and a
waiter that then finds an item neither present nor pending claims it anew, so one of the
waiters reads it. Without claims, the processes of one host coalesce through the
HostCoalescer (coalesce.py)."""
from __future__ import annotations

import time
from typing import Any

from cacheserver.vocab import FETCH, HIT, PENDING

from . import inserts
from .coalesce import BatchClaims
from .procstate import ProcessState

# Longest wait for other jobs' inserts of items they claimed; a claim expires
# sooner (claims.DEFAULT_TTL), after which the item is claimed anew, and what is
# still awaited after this long is read here.
CLAIM_WAIT_LIMIT = 30.0


def fill(ds: Any, st: ProcessState, indices: list[int], ids: list[bytes], poisoned: list[bool]
         ) -> tuple[list[bytes], dict[str, int]]:
    """Fetch misses from the store in parallel and insert them; items that
    another job is reading meanwhile are taken from the cache instead."""
    if ds.claims and ds.insert and st.ring is not None:
        return _fill_claimed(ds, st, indices, ids, poisoned)
    items: list[bytes | None] = [None] * len(ids)
    with BatchClaims(st.coalescer, ids) as claims:  # released, every one, whatever raises
        store_bytes, inserted = _read_insert(ds, st, indices, items, claims.mine, poisoned)
        claims.release_mine()  # first: the readers this one waits for may wait for these
        claims.wait_others()
    waited = claims.others
    coalesced = 0
    bad: set[int] = set()  # poisoned values found after waiting: replaced, counted
    if waited:
        got = st.ring.get([ids[p] for p in waited], ds.job) if st.ring is not None else [None] * len(waited)
        for p, v in zip(waited, got):
            if v is not None:
                items[p] = ds.open_item(indices[p], v)
                if items[p] is None and not poisoned[p]:  # poisoned[p]: counted already
                    bad.add(p)
        coalesced = sum(items[p] is not None for p in waited)
        late = [p for p in waited if items[p] is None]
        late_bytes, late_inserted = _read_insert(ds, st, indices, items, late,
                                                 [poisoned[p] or p in bad for p in range(len(ids))])
        store_bytes += late_bytes
        inserted += late_inserted
    return items, dict(store_bytes=store_bytes, coalesced=coalesced, inserted=inserted, poisoned=len(bad))


def _fill_claimed(ds: Any, st: ProcessState, indices: list[int], ids: list[bytes], poisoned: list[bool]
                  ) -> tuple[list[bytes], dict[str, int]]:
    """fill across hosts: claim the misses on their servers (cacheserver/claims.py),
    read and insert those this job won, and wait for the others' inserts."""
    n = len(ids)
    codes = [FETCH] * n
    # A poisoned value is ours to replace; an item the manager gives no space
    # will not be inserted, so claiming it would only make others wait.
    ask = [p for p in range(n) if not poisoned[p] and ds.plan.insert_chunk(indices[p]) is not None]
    for p, c in zip(ask, st.ring.claim([ids[p] for p in ask], ds.job)):
        codes[p] = c
    items: list[bytes | None] = [None] * n
    mine = [p for p in range(n) if codes[p] == FETCH]
    store_bytes, inserted = _read_claimed(ds, st, indices, ids, items, mine, set(ask), poisoned)
    waited = [p for p in range(n) if codes[p] != FETCH]
    todo, bad, won = waited, set(), set()
    deadline = time.monotonic() + CLAIM_WAIT_LIMIT
    while todo:  # each round reads what it claimed anew, or is the last
        todo, ours = _await_inserts(ds, st, indices, ids, todo, items, bad, deadline)
        if not ours:
            break
        more_bytes, more_inserted = _read_claimed(ds, st, indices, ids, items, ours, set(ours), poisoned)
        store_bytes, inserted = store_bytes + more_bytes, inserted + more_inserted
        won.update(ours)
    late = [p for p in waited if items[p] is None]  # poisoned, no claims to be had, or waited too long
    late_bytes, late_inserted = _read_insert(ds, st, indices, items, late, [p in bad for p in range(n)])
    return items, dict(store_bytes=store_bytes + late_bytes, coalesced=len(waited) - len(late) - len(won),
                       inserted=inserted + late_inserted, poisoned=len(bad))


def _read_claimed(ds: Any, st: ProcessState, indices: list[int], ids: list[bytes], items: list[bytes | None],
                  positions: list[int], claimed: set[int], replace: list[bool]) -> tuple[int, int]:
    """_read_insert for positions of which `claimed` are this job's claims: those it
    does not put (a store read failed, the put reached no store) are given up, so
    that the jobs waiting on them go on at once."""
    unput: list[int] = []
    try:
        got = _read_insert(ds, st, indices, items, positions, replace, unput)
    except Exception:  # a store read failed: nobody is reading these now, say so before raising
        inserts.give_up(ds, st, [ids[p] for p in positions if p in claimed])
        raise
    inserts.give_up(ds, st, [ids[p] for p in unput if p in claimed])
    return got


def _read_insert(ds: Any, st: ProcessState, indices: list[int], items: list[bytes | None],
                 positions: list[int], replace: list[bool], unput: list[int] | None = None
                 ) -> tuple[int, int]:
    """Read items[p] for these positions from the store and insert them (replacing
    where replace[p]: a poisoned value). Returns (store bytes, inserted); `unput`
    gets the positions whose put reached no server (inserts.insert)."""
    for p, data in zip(positions, ds.read_store(st, [indices[p] for p in positions])):
        items[p] = data
    missed: list[int] = []
    inserted = inserts.insert(ds, st, [(indices[p], items[p], replace[p]) for p in positions], missed)
    if unput is not None:
        unput.extend(positions[k] for k in missed)
    return sum(len(items[p]) for p in positions), inserted


def _await_inserts(ds: Any, st: ProcessState, indices: list[int], ids: list[bytes], todo: list[int],
                   items: list[bytes | None], bad: set[int], deadline: float) -> tuple[list[int], list[int]]:
    """Take items from the cache as their claimants insert them, adding poisoned
    positions to `bad`. An item nobody holds a claim on any more (given up, lapsed)
    is claimed anew: one waiter wins it and the others wait on, where each used to
    read it. Returns (still awaited, won) as soon as it wins any: the caller reads
    those now, as others wait for them; ([], []) when done, (todo, []) at the deadline."""
    delay = 0.002
    while todo:
        codes = st.ring.lookup_pending([ids[p] for p in todo], ds.job)
        ready = [p for p, c in zip(todo, codes) if c == HIT]
        if ready:
            for p, v in zip(ready, st.ring.get([ids[p] for p in ready], ds.job)):
                if v is not None:
                    items[p] = ds.open_item(indices[p], v)
                    if items[p] is None:
                        bad.add(p)
        free = [p for p, c in zip(todo, codes) if c != PENDING and items[p] is None and p not in bad]
        todo = [p for p, c in zip(todo, codes) if c == PENDING]
        if free and time.monotonic() < deadline:
            again = st.ring.claim([ids[p] for p in free], ds.job)
            todo += [p for p, c in zip(free, again) if c != FETCH]  # WAIT, or PRESENT: got next round
            won = [p for p, c in zip(free, again) if c == FETCH]
            if won:
                return todo, won
        if not todo or time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return todo, []
