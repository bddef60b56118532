"""Substitutable-hit sampler: exactly once per epoch, whatever the cache holds."""
import random

import pytest

from clients.sampler import SubstitutableBatchSampler


def run_epoch(s):
    batches = list(s)
    flat = [i for b in batches for i in b]
    return batches, flat


@pytest.mark.parametrize("cached_fraction", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("n,bs", [(1000, 32), (1001, 64), (10, 64), (0, 8)])
def test_exactly_once_and_full_batches(cached_fraction, n, bs):
    rng = random.Random(1)
    cached = {i for i in range(n) if rng.random() < cached_fraction}
    s = SubstitutableBatchSampler(n, bs, lambda idx: [i in cached for i in idx], seed=3)
    for _ in range(2):
        batches, flat = run_epoch(s)
        assert sorted(flat) == list(range(n))
        assert all(len(b) == bs for b in batches[:-1])
        assert len(batches) == len(s)


def test_hits_first_then_misses():
    n, bs = 2000, 50
    cached = set(range(0, n, 10))  # 10% cached
    s = SubstitutableBatchSampler(n, bs, lambda idx: [i in cached for i in idx], seed=0, lookahead=10)
    batches, flat = run_epoch(s)
    first = batches[: len(cached) // bs // 2]
    hit_share = sum(i in cached for b in first for i in b) / sum(map(len, first))
    assert hit_share > 0.8  # the early batches are filled from the cache
    assert s.stats.planned_hits >= 0.8 * len(cached)
    assert s.stats.substituted > 0


@pytest.mark.parametrize("walk", [False, True])
def test_substituted_counts_hits_that_went_ahead_of_a_met_miss(walk):
    """`substituted` is a count of hits, not of deferrals: none with an empty or a full
    cache, and never more than the planned hits."""
    n, bs = 1000, 32
    for cached, expect_some in ((set(), False), (set(range(n)), False), (set(range(0, n, 10)), True)):
        s = SubstitutableBatchSampler(n, bs, lambda idx, c=cached: [i in c for i in idx], seed=2, walk=walk)
        run_epoch(s)
        st = s.stats
        assert st.planned_hits == len(cached)
        assert (st.substituted > 0) == expect_some and st.substituted <= st.planned_hits, (len(cached), st)
        if expect_some:  # with 10% cached, nearly every hit is taken ahead of some miss
            assert st.substituted >= 0.8 * st.planned_hits


def test_cache_changing_mid_epoch_and_failing_lookup():
    n, bs = 500, 20
    cached = set(range(50))
    calls = [0]

    def lookup(idx):
        calls[0] += 1
        if calls[0] == 3:
            raise ConnectionError("server died")
        if calls[0] == 5:
            cached.clear()  # the whole cache lost mid-epoch
            cached.update(range(400, 500))
        return [i in cached for i in idx]

    s = SubstitutableBatchSampler(n, bs, lookup, seed=1)
    _, flat = run_epoch(s)
    assert sorted(flat) == list(range(n))
    assert s.stats.lookup_failures == 1


def test_epochs_differ_and_are_reproducible():
    mk = lambda: SubstitutableBatchSampler(100, 10, None, seed=7)
    a, b = mk(), mk()
    ea1, ea2 = run_epoch(a)[1], run_epoch(a)[1]
    assert ea1 != ea2
    assert run_epoch(b)[1] == ea1
    b.set_epoch(1)
    assert run_epoch(b)[1] == ea2


def test_prefer_loads_the_preferred_misses_first():
    n, bs = 1000, 10
    s = SubstitutableBatchSampler(n, bs, lambda idx: [False] * len(idx), seed=2,
                                  prefer=lambda i: i < 100, walk=True)
    batches, flat = run_epoch(s)
    assert sorted(flat) == list(range(n))
    early = [i for b in batches[:5] for i in b]
    # windows of 100 random items hold ~10 preferred ones: most of each batch
    assert sum(i < 100 for i in early) / len(early) > 0.7


def test_drop_last_and_bad_args():
    s = SubstitutableBatchSampler(25, 10, None, drop_last=True)
    batches, flat = run_epoch(s)
    assert [len(b) for b in batches] == [10, 10] and len(s) == 2
    with pytest.raises(ValueError, match="batch_size >= 1"):
        SubstitutableBatchSampler(10, 0, None)
    with pytest.raises(RuntimeError, match="answered 1 flags for 10"):
        list(SubstitutableBatchSampler(10, 5, lambda idx: [True]))
    with pytest.raises(TypeError, match="drop_last must be a bool, got 'False'"):
        SubstitutableBatchSampler(10, 5, None, drop_last="False")


@pytest.mark.parametrize("walk", [False, True])
def test_misses_another_job_is_reading_are_taken_last(walk):
    # Look-ups answer 2 (PENDING) for items another job is reading from the store:
    # they will be hits soon, so a batch that needs misses takes the others first.
    n, bs = 40, 10
    being_read = set(range(0, n, 2))
    s = SubstitutableBatchSampler(n, bs, lambda idx: [2 if i in being_read else 0 for i in idx],
                                  seed=1, walk=walk)
    batches, flat = run_epoch(s)
    assert sorted(flat) == list(range(n))
    assert not being_read & set(batches[0]) and not being_read & set(batches[1])
    assert set(batches[2]) | set(batches[3]) == being_read
    assert s.stats.planned_hits == 0  # PENDING is not a hit


def test_miss_seed_makes_the_misses_order_repeat():
    n, bs = 1000, 32
    cached = set(range(0, n, 10))

    def epoch(miss_seed):
        s = SubstitutableBatchSampler(n, bs, lambda idx: [i in cached for i in idx], seed=5, miss_seed=miss_seed)
        return run_epoch(s)[0]

    assert epoch(7) == epoch(7)
    assert epoch(None) != epoch(None)  # drawn per sampler: equal seeds still pick different misses


def test_a_cached_dataset_comes_in_a_new_order_every_epoch_and_per_seed():
    """All hits: the front walks the shared order, but what it finds is shuffled."""
    def epochs(seed):
        s = SubstitutableBatchSampler(2000, 64, lambda idx: [True] * len(idx), seed=seed)
        return [run_epoch(s)[1] for _ in range(2)]

    (a1, a2), (b1, _), (c1, _) = epochs(1), epochs(2), epochs(1)
    assert sorted(a1) == sorted(a2) == list(range(2000))
    assert a1 != a2 and a1 != b1
    assert a1 == c1  # the seed fixes the order
