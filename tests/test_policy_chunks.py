import json

import pytest

from manager.policy.chunks import (ChunkPlan, chunk_len, chunk_members, chunk_of, iter_chunk,
                                   num_chunks, partition_bounds)


def _assignment(n: int, k: int) -> dict[int, int]:
    seen: dict[int, int] = {}
    for c in range(k):
        for i in iter_chunk(c, n, k):
            assert i not in seen, f"item {i} in chunks {seen[i]} and {c} (n={n}, k={k})"
            seen[i] = c
    return seen


@pytest.mark.parametrize("n", list(range(0, 40)) + [99, 100, 101, 997, 1000, 1024])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 10, 16])
def test_partition_exact_and_balanced(n, k):
    seen = _assignment(n, k)
    assert sorted(seen) == list(range(n))           # every item in exactly one chunk
    for i in range(n):
        assert chunk_of(i, n, k) == seen[i]         # O(1) map agrees with members
    sizes = [chunk_len(c, n, k) for c in range(k)]
    assert max(sizes) - min(sizes) <= 1             # balanced overall, not just per partition
    assert sum(sizes) == n


@pytest.mark.parametrize("n,k", [(10, 3), (100, 7), (1001, 10), (5, 4)])
def test_partitions_contiguous_balanced_and_units_contiguous(n, k):
    bounds = [partition_bounds(p, n, k) for p in range(k)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lens = [b - a for a, b in bounds]
    assert max(lens) - min(lens) <= 1
    for c in range(k):
        ranges = chunk_members(c, n, k)
        assert len(ranges) == k
        for p, r in enumerate(ranges):                 # unit p of chunk c lies in partition p
            assert r.step == 1
            if len(r):
                assert bounds[p][0] <= r.start and r.stop <= bounds[p][1]
        # units of one partition are in chunk order
    for p in range(k):
        starts = [chunk_members(c, n, k)[p] for c in range(k)]
        assert all(a.stop == b.start for a, b in zip(starts, starts[1:]))


def test_each_chunk_is_a_uniform_sample():
    n, k = 10_000, 10
    for c in range(k):
        items = list(iter_chunk(c, n, k))
        mean = sum(items) / len(items)
        assert abs(mean - n / 2) < n * 0.06            # spans the whole digest
        assert min(items) < n / k and max(items) >= n - n / k
        # one slice from every decile: a length-sorted dataset still mixes
        assert {i * k // n for i in items} == set(range(k))


def test_n_smaller_than_k_squared_and_than_k():
    for n, k in [(3, 5), (7, 4), (15, 4), (1, 3)]:
        seen = _assignment(n, k)
        assert sorted(seen) == list(range(n))
        sizes = [chunk_len(c, n, k) for c in range(k)]
        assert max(sizes) - min(sizes) <= 1


def test_num_chunks():
    assert num_chunks(100, 10) == 10
    assert num_chunks(101, 10) == 11
    assert num_chunks(100, 0) == 1          # FULL: one chunk
    assert num_chunks(100, 200) == 1
    assert num_chunks(0, 10) == 1
    assert num_chunks(100, 1, n_items=7) == 7  # never more chunks than items
    assert num_chunks(100, 10, n_items=0) == 1
    with pytest.raises(ValueError):
        num_chunks(-1, 10)


def test_bad_arguments():
    with pytest.raises(ValueError):
        chunk_of(5, 5, 2)
    with pytest.raises(ValueError):
        chunk_of(0, 5, 0)
    with pytest.raises(ValueError):
        chunk_members(3, 10, 3)
    with pytest.raises(ValueError):
        ChunkPlan("d", 10, 2, active=2)


def test_plan_json_roundtrip():
    plan = ChunkPlan("sha256:abc", 1000, 10, active=3, loading=4, version=17)
    back = ChunkPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    assert back.chunk_of(999) == chunk_of(999, 1000, 10)
    assert back.members(3) == chunk_members(3, 1000, 10)
    assert ChunkPlan.from_dict({"dataset": "d", "n_items": 5, "k": 1}) == ChunkPlan("d", 5, 1)
