"""Pecan's AutoPlacement (manager/policy/placement.py) on synthetic and
recorded-style traces."""
import pytest

from manager.policy.placement import PlacePhase, Placement, PlacementConfig
from manager.policy.scaling import Measurement

from scaling_traces import drive, placement_model


@pytest.mark.parametrize("climb", ["ramp", "cachew"])
def test_moves_work_to_the_trainer_host_and_drops_remote_workers(climb):
    # 25 ms step, batch 32; remote items 8 ms, local items 4 ms, 3 spare cores
    model = placement_model()
    place, counts = drive(Placement.start_with(PlacementConfig(settle=1, climb=climb)), model, 200)
    assert place.converged
    assert (place.remote, place.local) == (4, 3)
    # phase 1 went remote-only first: the plateau at 10 remote workers, reached one at a
    # time (Cachew: 11 tried) or by the ramp (1, 2, 4, 8, 16, 17 tried, then 11, 10, 9);
    # no headroom in placement by default (TRIM owns the remote count)
    assert max(c[0] for c in counts) == (17 if climb == "ramp" else 11)
    assert place.bpt_conv == pytest.approx(32 / 1250)
    assert counts[:20].count((10, 0)) >= 1 and all(c[1] == 0 for c in counts[:16])
    # the 4th local worker was tried and taken back (contention), never kept
    assert max(c[1] for c in counts) == 4
    cfg = place.config
    ours = cfg.cost(model(4, 3).batch_time, 4)
    remote_only = cfg.cost(model(10, 0).batch_time, 10)
    assert ours <= 0.8 * remote_only                    # the placement bench's target
    assert model(4, 3).batch_time <= model(10, 0).batch_time / 0.95


def test_local_workers_alone_suffice_then_no_remote_worker_is_kept():
    model = placement_model(local_item_s=0.002)          # 3 locals: 1500 items/s
    place, _ = drive(Placement.start_with(PlacementConfig(settle=1)), model, 200)
    assert place.converged and (place.remote, place.local) == (0, 3)


def test_expensive_trainer_keeps_throughput_cheap_workers_go():
    # remote workers nearly free next to the trainer: cost ~ batch time, so
    # no removal that slows batches survives, even without the guard
    model = placement_model()
    cfg = PlacementConfig(settle=0, worker_price=0.001, slowdown_guard=None)
    place, _ = drive(Placement.start_with(cfg), model, 200)
    assert place.converged and place.remote == 5 and place.local == 3
    assert model(place.remote, place.local).batch_time == pytest.approx(0.025)


def test_pure_cost_rule_trades_throughput_when_workers_are_dear():
    # without the slowdown guard and with pricey workers Pecan's rule accepts
    # a slower batch for a smaller bill; the guard (default) refuses it
    model = placement_model()
    dear = PlacementConfig(settle=0, worker_price=1.0, slowdown_guard=None)
    free, free_counts = drive(Placement.start_with(dear), model, 200)
    guarded, _ = drive(Placement.start_with(PlacementConfig(settle=0, worker_price=1.0)), model, 200)
    # the pure rule cycles: down to no remote worker, re-check, regrow, down again
    assert min(c[0] for c in free_counts[-50:]) == 0 < guarded.remote
    assert model(guarded.remote, guarded.local).batch_time <= 1.05 * guarded.bpt_conv


@pytest.mark.parametrize("climb", ["ramp", "cachew"])
def test_settle_and_one_change_at_a_time(climb):
    model = placement_model()
    place = Placement.start_with(PlacementConfig(settle=2, climb=climb))
    changes = 0
    for _ in range(300):
        remote_phase = place.phase is PlacePhase.REMOTE
        c = place.observe(model(place.remote, place.local))
        if c is not None:
            changes += 1
            # only the ramp, in phase 1, moves more than one worker at a time
            big = climb == "ramp" and remote_phase and c.local_delta == 0
            assert (abs(c.remote_delta) <= 1 or big) and abs(c.local_delta) <= 1
            assert place.observe(Measurement(99.0)) is None   # straddling: dropped
            assert place.observe(Measurement(99.0)) is None
    assert place.converged and (place.remote, place.local) == (4, 3)
    assert changes < 40


def test_recheck_restarts_after_degradation_and_reconverges():
    cfg = PlacementConfig(settle=1, recheck_every=4)
    place, _ = drive(Placement.start_with(cfg), placement_model(), 200)
    assert (place.remote, place.local) == (4, 3)
    # remote workers got slower (a noisy neighbour): batches slow, placement re-runs
    place, counts = drive(place, placement_model(remote_item_s=0.016), 300)
    assert place.phase is PlacePhase.CONVERGED
    # 16 ms remote items: 8 remote + 3 local workers feed the 25 ms step again
    assert (place.remote, place.local) == (8, 3) and max(c[1] for c in counts) == 4
    assert placement_model(remote_item_s=0.016)(8, 3).batch_time <= 1.05 * place.bpt_conv


def test_journal_round_trip_and_config_errors():
    a_pol, a = drive(Placement.start_with(), placement_model(), 150)
    b_pol, b = drive(Placement.start_with(), placement_model(), 150, journal=True)
    assert a == b and a_pol.to_dict() == b_pol.to_dict()
    with pytest.raises(ValueError, match="prices"):
        PlacementConfig(worker_price=-1)
    with pytest.raises(ValueError, match="max_local"):
        PlacementConfig(max_local=-1)


def test_recorded_style_trace_with_bounded_iterations():
    # a table of measured batch times per (remote, local), as a sweep would record:
    # locals help up to 2 on this host; remote-only plateau at 6
    table = {}
    for r in range(0, 10):
        for l in range(0, 6):
            rate = r * 30 + l * 40
            step = 0.1 * (1.0 if l <= 2 else 1.2)
            table[r, l] = max(step, 16 / rate) if rate else 10.0
    model = lambda r, l: Measurement(table[min(r, 9), min(l, 5)])  # noqa: E731
    place, counts = drive(Placement.start_with(PlacementConfig(settle=0, max_remote=9)), model, 100)
    assert place.converged and place.local == 2
    assert model(place.remote, place.local).batch_time == pytest.approx(0.1)
    assert place.remote < 6


def test_never_removes_the_last_worker_of_all():
    """One remote worker on its plateau, and a local worker that slows batches (noise, or
    a host with no spare core): the local one goes, the remote one stays. Removing it too
    would leave no worker: no batch, no measurement, nothing to undo it (seen in
    tools/bench/placement on a loaded 2-core host)."""
    # headroom 0: phase 1 settles on the one remote worker this trace is about
    p = Placement.start_with(PlacementConfig(settle=0, min_remote=0, headroom=0))
    counts = []
    for bt in (0.10, 0.10, 0.10, 0.20, 0.10, 0.10):
        c = p.observe(Measurement(bt))
        counts.append((p.remote, p.local))
        assert p.remote + p.local >= 1, counts
    assert (1, 1) in counts and counts[-1] == (1, 0) and p.converged


@pytest.mark.parametrize("climb", ["ramp", "cachew"])
def test_spare_cores_replace_remote_workers_without_piling_up_local_ones(climb):
    """16 spare cores: no local worker ever slows batches. Pecan's rule added local workers
    up to max_local before removing any remote one (tools/bench/placement on 16 cores: 15
    local, 3 remote after 40 s, cost 1.00x remote-only's); TRIM removes remote workers as
    soon as local ones keep batch time, and stops adding local ones once none is left."""
    model = placement_model(free_cores=16)
    cfg = PlacementConfig(settle=1, climb=climb, max_local=32)
    place, counts = drive(Placement.start_with(cfg), model, 200)
    assert place.converged and (place.remote, place.local) == (0, 5)
    assert max(c[1] for c in counts) == 5                  # never more local workers than needed
    first = counts.index((0, 5))
    assert first < 60, first                               # windows, convergence included
    assert model(0, 5).batch_time <= 1.05 * place.bpt_conv
    # no worker bill left: half remote-only's cost at worker price 0.1 (the bench's target: <= 0.8x)
    assert cfg.cost(model(0, 5).batch_time, 0) == pytest.approx(0.5 * cfg.cost(model(10, 0).batch_time, 10))
