import os
import random

import pytest

from cacheserver.client.hashring import HashRing


def keys(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_routing_is_deterministic_and_total():
    nodes = [f"10.0.0.{i}:7000" for i in range(5)]
    a, b = HashRing(nodes), HashRing(reversed(nodes))
    ks = keys(2000)
    assert [a.node_for(k) for k in ks] == [b.node_for(k) for k in ks]
    routed = a.route(ks)
    assert sorted(i for idx in routed.values() for i in idx) == list(range(len(ks)))
    assert set(routed) <= set(nodes)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_adding_one_node_moves_about_one_over_n(n):
    nodes = [f"h{i}:1" for i in range(n)]
    before, after = HashRing(nodes), HashRing(nodes + ["new:1"])
    ks = keys(20000, seed=n)
    moved = [k for k in ks if before.node_for(k) != after.node_for(k)]
    share = len(moved) / len(ks)
    expect = 1 / (n + 1)
    assert abs(share - expect) < 0.35 * expect, (share, expect)
    # Only keys that now belong to the new node moved: nothing shuffles between old nodes.
    assert all(after.node_for(k) == "new:1" for k in moved)


@pytest.mark.parametrize("n", [3, 6])
def test_removing_one_node_moves_only_its_keys(n):
    nodes = [f"h{i}:1" for i in range(n)]
    before, after = HashRing(nodes), HashRing(nodes[1:])
    ks = keys(20000, seed=100 + n)
    moved = [k for k in ks if before.node_for(k) != after.node_for(k)]
    assert all(before.node_for(k) == nodes[0] for k in moved)
    assert abs(len(moved) / len(ks) - 1 / n) < 0.35 / n


def test_balance_with_virtual_nodes():
    ring = HashRing([f"h{i}:1" for i in range(8)])
    share = ring.describe()
    assert abs(sum(share.values()) - 1) < 1e-9
    assert max(share.values()) < 1.5 / 8 and min(share.values()) > 0.5 / 8


def test_empty_ring_and_bad_vnodes():
    with pytest.raises(LookupError, match="no nodes"):
        HashRing([]).node_for(os.urandom(32))
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(["a:1"], vnodes=0)
