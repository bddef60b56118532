"""The autocache decision (manager/policy/autocache.py) on synthetic costs;
recorded traces are in test_policy_autocache_trace.py."""
import math

import pytest

from manager.policy.autocache import (CLEAR, HEDGE, MODES, Decision, PipelineCosts, clear_estimate,
                                      costs_from_dict, costs_to_dict, decide, decision_from_dict,
                                      decision_to_dict, item_time, measuring_mode, merge_costs,
                                      project, redecide)

KIB = 1024


def costs(**kw) -> PipelineCosts:
    """The benchmark's shape: 2000 items of 128 KiB, store at ~64 MB/s."""
    base = dict(items=2000, epochs_left=2, source_bytes=128 * KIB, marker_bytes=128 * KIB * 2.5,
                store_read_s=0.002, cache_read_source_s=0.0003, cache_read_marker_s=0.0007,
                prefix_s=0.004, rest_s=0.0, workers=2, cacheable=True,
                source_cached=1.0, transformed_cached=1.0)
    base.update(kw)
    return PipelineCosts(**base)


def test_cpu_heavy_prefix_caches_transformed():
    d = decide(costs(prefix_s=0.008))
    assert d.mode == "transformed"
    assert d.costs["transformed"] < d.costs["source"] <= d.costs["compute"]
    assert "transformed" in d.reason and "prefix 8" in d.reason


def test_no_cpu_store_bound_caches_source_not_the_inflated_output():
    d = decide(costs(prefix_s=0.0, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.0025))
    assert d.mode == "source"
    assert d.costs["source"] == pytest.approx(2000 * 0.0003)
    assert d.costs["compute"] == pytest.approx(2000 * 0.002)


def test_fast_store_computes():
    # the store is as fast as the cache: caching gains nothing, so nothing is cached (tie rule)
    d = decide(costs(store_read_s=0.0003, prefix_s=0.0001, marker_bytes=128 * KIB,
                     cache_read_marker_s=0.0003))
    assert d.mode == "compute"
    assert set(d.costs) == set(MODES)


def test_tie_goes_to_fewer_cache_bytes():
    # CPU-bound either way: all three are equal, compute takes no bytes
    c = costs(store_read_s=0.001, prefix_s=0.0, rest_s=0.01, workers=1)
    assert decide(c).mode == "compute"
    # source and transformed tied (2% band), compute dearer: the smaller set wins
    c = costs(prefix_s=0.0, marker_bytes=128 * KIB * 2, cache_read_marker_s=0.000305)
    d = decide(c)
    assert d.costs["transformed"] <= d.costs["source"] * 1.02
    assert d.mode == "source"
    # deflating prefix: the transformed set is the smaller one
    c = costs(prefix_s=0.0, marker_bytes=64 * KIB, cache_read_marker_s=0.000299)
    assert decide(c).mode == "transformed"


def test_not_cacheable_never_transformed():
    d = decide(costs(prefix_s=0.002, cacheable=False, why_not="step 1 random, unseeded"))
    assert d.mode == "source" and "transformed" not in d.costs
    assert "not cacheable: step 1 random, unseeded" in d.reason


def test_no_epochs_left_computes():
    d = decide(costs(prefix_s=0.05, epochs_left=0))
    assert d.mode == "compute" and "no epochs left" in d.reason


def test_fill_is_amortised_over_the_remaining_epochs():
    # nothing cached yet: a transformed fill costs a compute epoch plus the puts
    c = costs(prefix_s=0.006, transformed_cached=0.0, put_marker_s=0.002, epochs_left=1)
    assert decide(c).mode != "transformed"
    assert decide(costs(prefix_s=0.006, transformed_cached=0.0, put_marker_s=0.002,
                        epochs_left=20)).mode == "transformed"


def test_projection_of_many_epochs_is_one_term_per_kind_of_epoch():
    """epochs_left is a uint32 from a client: its projection must not loop over it. Every
    epoch after the next costs the same, so the total is affine in epochs_left."""
    import dataclasses

    c = costs(prefix_s=0.006, transformed_cached=0.3, put_marker_s=0.002, epoch_done=0.5)

    def total(n: int) -> dict:
        span = n + 1.0 - c.epoch_done
        return {m: v * span for m, v in project(dataclasses.replace(c, epochs_left=n)).items()}

    t1, t2, t3, big = total(1), total(2), total(3), total(2**32 - 1)
    for m in t1:
        step = t3[m] - t2[m]
        assert t2[m] - t1[m] == pytest.approx(step)
        assert big[m] == pytest.approx(t1[m] + (2**32 - 2) * step)


def test_room_smaller_than_the_transformed_set():
    # 2000 x 1 MiB transformed does not fit 500 MiB: half the items are computed every epoch,
    # the 256 MiB source fits whole
    big = dict(prefix_s=0.002, marker_bytes=1024 * KIB, cache_read_marker_s=0.0008)
    assert decide(costs(**big)).mode == "transformed"
    d = decide(costs(room_bytes=500 * 1024 * KIB, **big))
    assert d.mode == "source"
    assert "holds 25% transformed, 100% source" in d.reason
    p = project(costs(room_bytes=500 * 1024 * KIB, source_cached=0.0, **big))
    phi = 0.25  # the misses read the store and run the prefix
    assert p["transformed"] == pytest.approx(
        2000 * item_time(phi * 0.0008 + (1 - phi) * 0.002, (1 - phi) * 0.002, 2))


def test_overlap_zero_is_cachews_sum():
    c = costs(prefix_s=0.004, rest_s=0.001, workers=1, epochs_left=1)
    p = project(c, overlap=0.0)
    assert p["compute"] == pytest.approx(2000 * (0.002 + 0.005))
    assert p["transformed"] == pytest.approx(2000 * (0.0007 + 0.001))
    p1 = project(c, overlap=1.0)
    assert p1["compute"] == pytest.approx(2000 * 0.005)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="store_read_s"):
        costs(store_read_s=-1)
    with pytest.raises(ValueError, match="prefix_s"):
        costs(prefix_s=math.nan)
    with pytest.raises(ValueError, match="items"):
        costs(items=0)
    with pytest.raises(ValueError, match="source_cached"):
        costs(source_cached=1.5)


def test_merge_sums_epochs_and_weights_means():
    a = costs(items=1000, epochs_left=1, prefix_s=0.002, workers=2)
    b = costs(items=3000, epochs_left=2, prefix_s=0.006, workers=4)
    m = merge_costs([a, b])
    assert m.epochs_left == 3 and m.items == 3000
    assert m.prefix_s == pytest.approx(0.005) and m.workers == 4
    assert merge_costs([a]) is a
    assert not merge_costs([a, costs(cacheable=False, why_not="x")]).cacheable
    with pytest.raises(ValueError):
        merge_costs([])


def test_round_trips():
    c = costs(why_not="")
    assert costs_from_dict(costs_to_dict(c)) == c
    c = costs(room_bytes=1e9)
    assert costs_from_dict(costs_to_dict(c)) == c
    d = decide(c)
    assert decision_from_dict(decision_to_dict(d)) == d
    with pytest.raises(ValueError):
        decision_from_dict({"mode": "everything", "costs": {}, "reason": ""})
    assert isinstance(d, Decision)


def test_decision_a_quarter_into_the_first_epoch_projects_its_rest():
    # "auto" decides after 25% of epoch 1 with 25% of the source items cached: the rest of
    # epoch 1 runs in the chosen mode and fills, then 2 more epochs
    c = costs(prefix_s=0.001, epochs_left=2, epoch_done=0.25, source_cached=0.25, transformed_cached=0.0)
    p = project(c)
    span = 2.75
    # source: the rest of epoch 1 reads the 75% not read (nor cached) yet, from the store
    src = 0.75 * item_time(0.002, 0.001, 2) + 2 * item_time(0.0003, 0.001, 2)
    assert p["source"] == pytest.approx(2000 * src / span)
    # transformed: the rest of epoch 1 computes and puts 75% of the set; epoch 2 hits those and
    # computes the 25% read before the decision (their source items are cached), epoch 3 hits
    tr = (0.75 * item_time(0.002, 0.001, 2) + item_time(0.75 * 0.0007 + 0.25 * 0.0003, 0.25 * 0.001, 2)
          + item_time(0.0007, 0.0, 2))
    assert p["transformed"] == pytest.approx(2000 * tr / span)
    assert p["compute"] == pytest.approx(2000 * item_time(0.002, 0.001, 2))
    # the fills cost more over a short run than over a long one
    long = project(costs(prefix_s=0.001, epochs_left=50, epoch_done=0.25, source_cached=0.25,
                         transformed_cached=0.0))
    assert long["transformed"] < p["transformed"] and long["source"] < p["source"]


def test_handoff_to_workers_counts_where_steps_run():
    # f = 8 outputs cost 1.3 ms each to move out of a worker: a source hit pays it, a
    # transformed hit with nothing after the caching point does not
    c = costs(prefix_s=0.0, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.0011, handoff_s=0.0013,
              epochs_left=1)
    p = project(c)
    assert p["source"] == pytest.approx(2000 * (0.0003 + 0.0013))
    assert p["transformed"] == pytest.approx(2000 * 0.0011)
    assert decide(c).mode == "transformed"
    assert decide(costs(prefix_s=0.0, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.0011,
                        epochs_left=1)).mode == "source"          # blind to the handoff
    # steps after the caching point: its hits go to the workers too
    p = project(costs(prefix_s=0.0, rest_s=0.0001, cache_read_marker_s=0.0011, handoff_s=0.0013, epochs_left=1))
    assert p["transformed"] == pytest.approx(2000 * (0.0011 + 0.0013))


def test_measuring_mode_follows_the_estimate():
    # before the first epoch: nothing cached, the whole run ahead
    start = dict(epoch_done=0.0, source_cached=0.0, transformed_cached=0.0, epochs_left=2)
    # CPU-heavy: transformed clearly cheapest, the measured part runs as transformed
    mode, keep, d = measuring_mode(costs(prefix_s=0.004, marker_bytes=128 * KIB, **start))
    assert (mode, keep, d.mode) == ("transformed", True, "transformed")
    # 8x outputs, no CPU: dearer to put and read back than to recompute -- run exactly as source
    mode, keep, d = measuring_mode(costs(prefix_s=0.0, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.0025,
                                         put_marker_s=0.002, handoff_s=0.0008, **start))
    assert (mode, keep, d.mode) == ("source", False, "source")
    assert d.costs["transformed"] > d.costs["source"] * (1 + HEDGE)
    # not cacheable: never kept
    mode, keep, d = measuring_mode(costs(prefix_s=0.004, cacheable=False, why_not="random", **start))
    assert (mode, keep) == ("source", False) and "transformed" not in d.costs


def test_measuring_mode_hedges_a_near_tie():
    # transformed projected within HEDGE of source, either side: run as source (the source items
    # are cached) and keep the outputs (a transformed decision makes nothing of that part again)
    base = dict(epoch_done=0.0, source_cached=0.0, transformed_cached=0.0, epochs_left=2, prefix_s=0.0,
                marker_bytes=128 * KIB * 2)

    def at(ratio: float) -> float:
        """The marker read at which transformed costs `ratio` x the cheapest other option."""
        lo, hi = 0.0, 0.01
        for _ in range(60):
            mid = (lo + hi) / 2
            p = project(costs(cache_read_marker_s=mid, **base))
            lo, hi = (mid, hi) if p["transformed"] < ratio * min(p["source"], p["compute"]) else (lo, mid)
        return lo

    for ratio in (1 - HEDGE / 2, 1 + HEDGE / 2):
        mode, keep, _ = measuring_mode(costs(cache_read_marker_s=at(ratio), **base))
        assert (mode, keep) == ("source", True), ratio
    assert measuring_mode(costs(cache_read_marker_s=at(1 - 2 * HEDGE), **base))[:2] == ("transformed", True)
    assert measuring_mode(costs(cache_read_marker_s=at(1 + 2 * HEDGE), **base))[:2] == ("source", False)


def test_clear_estimate_only_beyond_its_margin():
    # the estimate's option cheaper than every other by CLEAR: decided before the first epoch
    assert clear_estimate(Decision("transformed", {"compute": 5.0, "source": 2.5, "transformed": 2.0}, ""))
    # within CLEAR of another option (either side of it): the first epoch is measured first
    assert not clear_estimate(Decision("transformed", {"compute": 5.0, "source": 2.4, "transformed": 2.0}, ""))
    assert not clear_estimate(Decision("source", {"compute": 5.0, "source": 2.0, "transformed": 1.99}, ""))
    assert clear_estimate(Decision("source", {"compute": 2.0 * (1 + CLEAR), "source": 2.0}, ""))
    assert not clear_estimate(Decision("source", {"compute": 2.0, "source": 2.0}, ""), margin=0.01)
    assert clear_estimate(Decision("compute", {"compute": 2.0, "source": 2.0}, ""), margin=0.0)
    # a decision whose option was not projected (the manager's, say) is never taken as clear
    assert not clear_estimate(Decision("transformed", {"compute": 5.0, "source": 2.0}, ""))
    # on an estimate: a CPU-heavy prefix is clear, the bench's near tie at 8x and 1 ms is not
    start = dict(epoch_done=0.0, source_cached=0.0, transformed_cached=0.0, epochs_left=2)
    assert clear_estimate(measuring_mode(costs(prefix_s=0.004, marker_bytes=128 * KIB, **start))[2])
    near = costs(prefix_s=0.0013, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.0004, handoff_s=0.0001,
                 put_marker_s=0.0023, store_read_s=0.0027, cache_read_source_s=0.0001, **start)
    assert not clear_estimate(measuring_mode(near)[2])


def test_redecide_only_where_the_mode_in_force_is_clearly_wrong():
    cur = decide(costs(prefix_s=0.008))
    assert cur.mode == "transformed"
    assert redecide(cur, costs(prefix_s=0.008)) is None  # the same measurements: kept
    # measured again, source now wins but transformed projects only ~17% dearer: kept
    near = costs(prefix_s=0.0, marker_bytes=128 * KIB * 2, cache_read_marker_s=0.00035)
    d = decide(near)
    assert d.mode == "source" and 1.02 < d.costs["transformed"] / d.costs["source"] < 1.25
    assert redecide(cur, near) is None
    # 8x outputs read back at 4 ms: transformed projects 4x dearer than source: re-decided
    far = costs(prefix_s=0.0, marker_bytes=128 * KIB * 8, cache_read_marker_s=0.004)
    new = redecide(cur, far)
    assert new is not None and new.mode == "source" and new.costs == decide(far).costs
    assert new.reason.startswith("re-decided, was transformed (") and decide(far).reason in new.reason
    # a job found the pipeline not cacheable: transformed cannot stay, whatever the margin
    new = redecide(cur, costs(prefix_s=0.008, cacheable=False, why_not="a random step"))
    assert new is not None and new.mode != "transformed" and "was transformed (not cacheable now)" in new.reason


def test_the_hosts_cores_bound_an_option_by_its_cpu_per_item():
    """Recorded at f = 8, s = 0.5 ms on 2 cores (tools/bench/autocache, auto's own costs at its
    decision): source's epochs ran 2.1-2.3 s against transformed's 0.75-0.8, yet the pipelined
    model, which gives the loader and each worker a core of their own, tied them and took source.
    Counted over the 2 cores the host has (cache read, both ends of the hand-off, the steps),
    source is dearer and transformed is chosen; with the cores unknown nothing changes."""
    recorded = dict(items=2000, epochs_left=2, source_bytes=131072.0, marker_bytes=1048602.0,
                    store_read_s=0.002578, cache_read_source_s=8.25e-05, cache_read_marker_s=0.000331,
                    prefix_s=0.000615, rest_s=0.0, workers=2, cacheable=True, source_cached=0.133,
                    transformed_cached=0.129, put_marker_s=0.00169, epoch_done=0.128, handoff_s=0.000238)
    unknown = PipelineCosts(**recorded)
    two = PipelineCosts(**recorded, cores=2.0)
    assert decide(unknown).mode == "source"
    assert decide(two).mode == "transformed"
    p0, p2 = project(unknown), project(two)
    assert p2["source"] > p0["source"] * 1.1
    assert p2["transformed"] == pytest.approx(p0["transformed"], rel=0.1)
    many = PipelineCosts(**recorded, cores=64.0)
    assert project(many) == pytest.approx(p0)
