"""The manager's chunk plan in shared memory (SharedPlan): the job's coordinator
(clients/coordination.py) publishes it, every DataLoader worker reads which items it may
insert, and under which chunk."""
from __future__ import annotations

import multiprocessing
import time

from cacheserver.vocab import Option
from manager.manager_client import Plan, chunk_of

# The plan's option as the shared array holds it; _SPARE: a "none" plan whose
# misses go in as spare entries.
_CODES = {Option.NONE: 0, Option.FULL: 1, Option.CHUNKED: 2}
_SPARE = 3
MAX_CHUNKS = 61  # chunk numbers a plan may list (the shared array's tail)
SPARE = -1  # the chunk tag of an item outside the plan's chunks
_READ_TRIES = 10_000  # SharedPlan reads of a plan being written before giving up


class SharedPlan:
    """The current plan in shared memory: [seq, option, k, n_items, n_chunks, chunks...].

    ``seq`` is 0 until the first plan ("full, one chunk": insert everything without a
    manager), odd while ``publish`` writes, even otherwise: a reader (a DataLoader worker,
    or a thread of this process) takes the fields only between two equal even reads of it
    (a seqlock), so it never mixes two plans' chunking and chunk lists, nor reads a plan
    half written (an item tagged under a chunk it is not in)."""

    def __init__(self) -> None:
        self._arr = multiprocessing.get_context("spawn").RawArray("q", 5 + MAX_CHUNKS)
        self._arr[1] = _CODES[Option.FULL]
        self._arr[2] = 1

    def publish(self, plan: Plan) -> None:
        chunks = list(plan.chunks)
        if plan.loading is not None:
            chunks.append(plan.loading)  # the chunk being loaded is inserted into too
        chunks = sorted(set(chunks))[:MAX_CHUNKS]
        option = Option(plan.option)  # before the writing starts: nothing raises half-way
        code = _SPARE if option is Option.NONE and plan.spare else _CODES[option]
        a = self._arr
        a[0] += 1  # odd: being written
        a[1], a[2], a[3], a[4] = code, max(1, plan.k), plan.n_items, len(chunks)
        for j, c in enumerate(chunks):
            a[5 + j] = c
        a[0] += 1

    def _read(self) -> tuple[int, int, int, list[int]] | None:
        """(option, k, n_items, chunks) of one publication; None if none could be read
        whole in a bounded wait (a writer stopped mid-way)."""
        a = self._arr
        for attempt in range(_READ_TRIES):
            seq = a[0]
            if not seq % 2:
                option, k, n, m = a[1], a[2], a[3], a[4]
                chunks = a[5:5 + m]
                if a[0] == seq:
                    return option, k, n, chunks
            if attempt:
                time.sleep(0)  # let a writer in this process (a thread) finish
        return None

    def insert_chunk(self, i: int) -> int | None:
        """Chunk tag to insert item i under, or None if the plan says not to insert it.

        With a chunked plan, an item outside its chunks is inserted as SPARE (with a
        "none" plan that allows spare entries, every item is): servers
        keep such entries only in room no chunk needs (evicted first, evicting only
        each other), so jobs still share their misses there while the chunks turn
        over slower than the jobs read (cacheserver/store.py, is_spare)."""
        got = self._read()
        if got is None:
            return None  # no plan to go by: insert nothing rather than under a wrong tag
        option, k, n, chunks = got
        if option == _CODES[Option.FULL]:
            return 0
        if option == _CODES[Option.NONE]:
            return None
        if option == _SPARE:  # no room of its own: share misses in the room nobody needs
            return SPARE
        c = chunk_of(i, n, k)
        return c if c in chunks else SPARE

    def loading_first(self, i: int, loading: int | None) -> bool:
        return loading is not None and self._arr[0] != 0 and self.insert_chunk(i) == loading
