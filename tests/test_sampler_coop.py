"""The sampler's shared front: invariants under any cache, and co-operation between jobs."""
import random
from collections import OrderedDict

import pytest

from clients.sampler import SubstitutableBatchSampler


@pytest.mark.parametrize("lookahead", [1, 2, 10])
@pytest.mark.parametrize("n,bs", [(997, 32), (64, 64), (5, 8)])
def test_exactly_once_while_the_cache_churns(n, bs, lookahead):
    rng = random.Random(n * lookahead)
    cached: set[int] = set()

    def lookup(idx):
        for _ in range(rng.randint(0, 20)):  # the cache changes between look-ups
            i = rng.randrange(n)
            (cached.discard if rng.random() < 0.5 else cached.add)(i)
        return [i in cached for i in idx]

    s = SubstitutableBatchSampler(n, bs, lookup, seed=1, lookahead=lookahead)
    for _ in range(3):
        batches = list(s)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert all(len(b) == bs for b in batches[:-1]) and len(batches) == len(s)


def coop_store_reads(n, jobs, frac=0.1, seeds=None, epochs=1, walk=False, prefer=None):
    """Jobs in step over one LRU cache of `frac` x n items; a job's misses are inserted
    only after the other jobs' next batch (reads in flight). Returns store reads / n."""
    lru: OrderedDict[int, None] = OrderedDict()
    cap = int(frac * n)

    def insert(items):
        for i in items:
            lru[i] = None
            lru.move_to_end(i)
            while len(lru) > cap:
                lru.popitem(last=False)

    lookup = lambda idx: [i in lru for i in idx]
    seeds = seeds or list(range(jobs))
    samplers = [SubstitutableBatchSampler(n, 32, lookup, seed=sd, walk=walk, prefer=prefer) for sd in seeds]
    reads = 0
    for _ in range(epochs):
        its = [iter(s) for s in samplers]
        in_flight: list[list[int]] = []
        live = list(range(jobs))
        while live:
            for j in list(live):
                b = next(its[j], None)
                if b is None:
                    live.remove(j)
                    continue
                miss = [i for i in b if i not in lru]
                for i in b:
                    if i in lru:
                        lru.move_to_end(i)
                reads += len(miss)
                in_flight.append(miss)
                if len(in_flight) > jobs - 1:
                    insert(in_flight.pop(0))
        for m in in_flight:
            insert(m)
    return reads / n / epochs


def test_jobs_in_step_read_each_item_about_once():
    # the shared front: 1.19-1.26x in 200 runs (the excess: two jobs picking the same
    # miss while its read is in flight); the paper's walk over each job's own
    # permutation (walk=True) 1.35x: items are evicted before the others
    # come across them
    assert coop_store_reads(2000, 4) < 1.3
    assert coop_store_reads(2000, 4, walk=True) > 1.3
    # a chunk hint (the manager's loading chunk) leaves the shared front as it is
    assert coop_store_reads(2000, 4, prefer=lambda i: i % 10 == 0) < 1.3
    assert coop_store_reads(2000, 4, epochs=2) < 1.3


def test_jobs_with_equal_seeds_still_split_their_misses():
    assert coop_store_reads(2000, 4, seeds=[0, 0, 0, 0]) < 1.3


def test_a_cache_filled_earlier_is_used_first():
    n, bs = 3000, 32
    cached = set(random.Random(5).sample(range(n), n // 10))
    s = SubstitutableBatchSampler(n, bs, lambda idx: [i in cached for i in idx], seed=3)
    batches = list(s)
    first = [i for b in batches[: len(cached) // bs] for i in b]
    assert sum(i in cached for i in first) / len(first) > 0.8
    assert s.stats.planned_hits == len(cached)
